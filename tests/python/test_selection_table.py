"""bench/selection_table.py: the committed selection table is what the tool derives from the runs
it names, and the tool's rules (fastest per size, ties to the simpler algorithm, runs merged,
NCCL past the measured sizes on a GPU and the last winner on the CPU, merging a new GPU's rows
ahead of the wildcard rows)."""

import os
import re
import sys
import tempfile
import unittest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))

import selection_table  # noqa: E402


def record(gpu, world, tokens, impl, us, hidden=1024, dtype="bf16"):
    return {"op": "allreduce_add_rmsnorm", "impl": impl, "gpu": gpu, "world_size": world,
            "tokens": tokens, "hidden": hidden, "dtype": dtype, "us": us, "backend": "cuda",
            "driver": "1", "cuda": "13.0", "nccl": "2.28", "commit": "abc", "date": "2026-01-01",
            "method": "graphs"}


def data_rows(text):
    return [line for line in text.splitlines()
            if line and not line.startswith("#") and line != selection_table.HEADER]


class SelectionTable(unittest.TestCase):
    def test_the_committed_table_is_derived_from_the_runs_it_names(self):
        import json

        with open(os.path.join(ROOT, "data", "algorithms.csv")) as file:
            lines = file.read().splitlines()
        # The blocks the tool wrote: a comment naming its run, then the rows of one device and
        # world size.
        blocks, comments, rows = [], [], []
        for line in lines[lines.index(selection_table.HEADER) + 1:]:
            if line.startswith("#"):
                if rows:
                    blocks.append((comments, rows))
                    comments, rows = [], []
                comments.append(line[1:].strip())
            elif line.strip():
                rows.append(line)
        blocks.append((comments, rows))
        derived = [(" ".join(c), r) for c, r in blocks
                   if any("Rows by bench/selection_table.py" in line for line in c)]
        groups = {tuple(r[0].split(",")[:2]) for _, r in derived}
        self.assertIn(("NVIDIA H200", "2"), groups)
        self.assertIn(("cpu", "2"), groups)
        for note, committed in derived:
            named = re.search(r"\((bench/results/[^)]+\.json)\)", note)
            self.assertIsNotNone(named, f"no results file named above {committed[0]}")
            with open(os.path.join(ROOT, named.group(1))) as file:
                records = json.load(file)
            device, world = committed[0].split(",")[:2]
            sizes = selection_table.measurements(records)[(device, int(world))]
            self.assertEqual(committed, selection_table.table_rows(
                device, int(world), selection_table.device_rows(device, sizes)))

    def test_cpu_runs_give_rows_for_the_cpu_device_without_nccl(self):
        def cpu_record(world, tokens, impl, us):
            return {"op": "allreduce_add_rmsnorm", "impl": impl, "gpu": "cpu", "world_size": world,
                    "tokens": tokens, "hidden": 1024, "dtype": "bf16", "us": us,
                    "backend": "cpu", "host_cpu": "Some CPU", "commit": "abc",
                    "date": "2026-01-01", "method": "threads"}

        # tokens: one-shot, two-shot, one-shot again (noise: still two-shot), two-shot.
        records = [cpu_record(4, 1, "tpfuse_oneshot_cpu", 10.0),
                   cpu_record(4, 1, "tpfuse_twoshot_cpu", 15.0),
                   cpu_record(4, 8, "tpfuse_oneshot_cpu", 60.0),
                   cpu_record(4, 8, "tpfuse_twoshot_cpu", 50.0),
                   cpu_record(4, 16, "tpfuse_oneshot_cpu", 100.0),
                   cpu_record(4, 16, "tpfuse_twoshot_cpu", 110.0),
                   cpu_record(4, 64, "tpfuse_oneshot_cpu", 300.0),
                   cpu_record(4, 64, "tpfuse_twoshot_cpu", 200.0),
                   # a GPU run's CPU-named impl, and a CPU run's GPU-named one: neither counts
                   record("GPU X", 4, 1, "tpfuse_oneshot_cpu", 1.0),
                   dict(cpu_record(4, 1, "tpfuse_oneshot", 1.0))]
        groups = selection_table.measurements(records)
        self.assertEqual(set(groups), {("cpu", 4)})
        # One crossover, at the first size two-shot wins; never NCCL (a CPU team's NCCL path is
        # a stand-in).
        self.assertEqual(selection_table.device_rows("cpu", groups[("cpu", 4)]),
                         [(2048, "oneshot"), (None, "twoshot")])
        self.assertEqual(selection_table.cpu_rows({1: {"oneshot": 1.0, "twoshot": 2.0}}),
                         [(None, "oneshot")])
        self.assertEqual(selection_table.cpu_rows({1: {"oneshot": 2.0, "twoshot": 1.0}}),
                         [(None, "twoshot")])
        note = selection_table.note(records, "cpu", 4, groups[("cpu", 4)], "run.json")
        self.assertIn("CPU teams (Some CPU), 4 ranks", " ".join(note))
        columns = next(line for line in note if line.startswith("#   bytes"))
        self.assertNotIn("nccl", columns)

    def test_fastest_per_size_ties_to_the_simpler_runs_merged_nccl_beyond(self):
        records = []
        # tokens: one-shot fastest, then within 1% of two-shot (a tie: one-shot), then two-shot,
        # then one-shot cannot carry it and two-shot wins, then NCCL wins.
        for tokens, one, two, nccl in ((1, 3.0, 4.0, 8.0), (16, 5.0, 4.96, 9.0),
                                       (256, 9.0, 8.0, 20.0), (1024, None, 20.0, 40.0),
                                       (4096, None, 90.0, 80.0)):
            for impl, us in (("tpfuse_oneshot", one), ("tpfuse_twoshot", two),
                             ("tpfuse_nccl", nccl)):
                if us is not None:
                    records.append(record("GPU X", 4, tokens, impl, us))
        records.append(record("GPU X", 4, 1, "tpfuse_auto", 1.0))  # not a forced algorithm
        sizes = selection_table.measurements(records)[("GPU X", 4)]
        self.assertEqual(selection_table.rows(sizes),
                         [(16 * 2048, "oneshot"), (1024 * 2048, "twoshot"), (None, "nccl")])
        # With NCCL never fastest, a last row still sends what was not measured to NCCL.
        self.assertEqual(selection_table.rows({100: {"oneshot": 1.0}}),
                         [(100, "oneshot"), (None, "nccl")])

    def test_merge_replaces_a_groups_rows_and_puts_new_ones_ahead_of_wildcards(self):
        table = "\n".join([
            "# the table's description", selection_table.HEADER,
            "# old note for GPU X, 4 ranks", "GPU X,4,100,oneshot", "GPU X,4,inf,nccl",
            "# another GPU", "GPU Y,2,inf,twoshot",
            "# defaults", "*,*,1048576,oneshot", "*,*,inf,nccl"]) + "\n"
        merged = selection_table.merge(table, {("GPU X", 4): ["# new note", "GPU X,4,inf,nccl"],
                                               ("GPU Z", 8): ["GPU Z,8,5,oneshot"]})
        self.assertEqual(data_rows(merged), ["GPU X,4,inf,nccl", "GPU Z,8,5,oneshot",
                                             "GPU Y,2,inf,twoshot", "*,*,1048576,oneshot",
                                             "*,*,inf,nccl"])
        self.assertNotIn("old note", merged)
        self.assertIn("# new note", merged)
        self.assertIn("# another GPU", merged)
        self.assertTrue(merged.startswith("# the table's description\n"))

    def test_a_run_narrower_than_the_rows_it_replaces_is_named(self):
        table = "\n".join([selection_table.HEADER, "GPU X,4,100,oneshot", "GPU X,4,400,twoshot",
                           "GPU X,4,inf,nccl", "GPU Y,2,inf,nccl"]) + "\n"
        narrow = {("GPU X", 4): {50: {"oneshot": 1.0}, 200: {"twoshot": 1.0}},
                  ("GPU Y", 2): {10: {"oneshot": 1.0}}}
        self.assertEqual(selection_table.narrowed(table, narrow), [("GPU X", 4, 200, 400)])
        wide = {("GPU X", 4): {50: {"oneshot": 1.0}, 400: {"twoshot": 1.0}}}
        self.assertEqual(selection_table.narrowed(table, wide), [])

    def test_the_command_prints_rows_and_refuses_a_file_without_them(self):
        import json

        path = os.path.join(tempfile.mkdtemp(), "run.json")
        with open(path, "w") as file:
            json.dump([record("GPU X", 2, 1, "tpfuse_oneshot", 3.0)], file)
        self.assertEqual(selection_table.main([path]), 0)
        with open(path, "w") as file:
            json.dump([{"op": "floor", "impl": "nvlink_one_way", "us": 0.7}], file)
        self.assertEqual(selection_table.main([path]), 1)


if __name__ == "__main__":
    unittest.main()
