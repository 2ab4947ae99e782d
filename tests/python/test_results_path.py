"""The Python benchmark drivers' results naming (bench/results_path.py, tpfuse-bench's rule):
nothing written unless asked, the time in the default name, a taken name gets the first free
numeric suffix and no earlier file is ever overwritten."""

import argparse
import datetime
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import results_path  # noqa: E402


def parse(argv):
    parser = argparse.ArgumentParser()
    results_path.add_arguments(parser)
    return parser.parse_args(argv)


class ResultsPath(unittest.TestCase):
    def test_the_default_name_has_device_world_time_commit_and_kind(self):
        when = datetime.datetime(2026, 11, 30, 23, 35, 54, tzinfo=datetime.timezone.utc)
        self.assertEqual(results_path.results_stem("NVIDIA H200", 2, when, "81e26ad", "e2e"),
                         "nvidia-h200-x2-20261130-233554-81e26ad-e2e")

    def test_nothing_is_written_unless_asked(self):
        self.assertEqual(results_path.reserve(parse([]), "cpu", 1, "abc", "e2e"), "")

    def test_out_dir_and_out_never_overwrite(self):
        directory = tempfile.mkdtemp()
        when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
        args = parse(["--out-dir", os.path.join(directory, "new")])
        first = results_path.reserve(args, "cpu", 1, "abc", "e2e", when)
        self.assertEqual(first, os.path.join(directory, "new", "cpu-x1-20260102-030405-abc-e2e.json"))
        with open(first, "w") as file:
            file.write("earlier")
        second = results_path.reserve(args, "cpu", 1, "abc", "e2e", when)
        self.assertEqual(second, first[:-len(".json")] + "-1.json")
        out = parse(["--out", first])
        self.assertEqual(results_path.reserve(out, "cpu", 1, "abc", "e2e"),
                         first[:-len(".json")] + "-2.json")
        with open(first) as file:
            self.assertEqual(file.read(), "earlier")

    def test_out_and_out_dir_exclude_each_other(self):
        with self.assertRaises(SystemExit):
            parse(["--out", "a.json", "--out-dir", "b"])


if __name__ == "__main__":
    unittest.main()
