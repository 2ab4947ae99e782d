"""Where the Python benchmark drivers write results, by tpfuse-bench's rule (bench/results_path.h):
nothing unless asked; `--out PATH`, or `--out-dir DIR` for the default name
<device>-x<world>-<YYYYMMDD>-<HHMMSS>-<commit>-<kind>.json (UTC); a name already taken gets -1,
-2, ... before the extension, so no run overwrites another (the file is created exclusively)."""

import datetime
import os
import re
import subprocess


def commit():
    """TPFUSE_BENCH_COMMIT, else the short commit of this checkout, else 'unknown'."""
    if os.environ.get("TPFUSE_BENCH_COMMIT"):
        return os.environ["TPFUSE_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse",
                               "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def slug(name):
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def results_stem(device, world, when, commit, kind):
    stamp = when.astimezone(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{slug(device)}-x{world}-{stamp}-{commit}-{kind}"


def create_unique_file(wanted):
    """Creates `wanted`, or the first free <stem>-N<ext> beside it; returns the path created."""
    parent = os.path.dirname(wanted)
    if parent:
        os.makedirs(parent, exist_ok=True)
    stem, extension = os.path.splitext(wanted)
    for suffix in range(10000):
        candidate = wanted if suffix == 0 else f"{stem}-{suffix}{extension}"
        try:
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"no free name for {wanted}")


def add_arguments(parser):
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--out", default="",
                       help="results JSON at OUT (taken: OUT-1.json, ...; never overwritten)")
    group.add_argument("--out-dir", default="",
                       help="results JSON in OUT_DIR under <device>-x<world>-<date>-<time>-"
                            "<commit>-<kind>.json (taken: -1, -2, ...)")


def reserve(args, device, world, commit, kind, when=None):
    """The file this run writes ('' when neither --out nor --out-dir was given), created now."""
    if args.out:
        return create_unique_file(args.out)
    if args.out_dir:
        when = when or datetime.datetime.now(datetime.timezone.utc)
        name = results_stem(device, world, when, commit, kind) + ".json"
        return create_unique_file(os.path.join(args.out_dir, name))
    return ""
