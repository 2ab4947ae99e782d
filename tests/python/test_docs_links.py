"""The docs link only to what is there: every relative markdown link (and image) in README.md,
CHANGELOG.md, docs/*.md and bench/results/README.md names a tracked file, and a `#section` part
names a heading of that file. No torch needed."""

import glob
import os
import re
import subprocess
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow) or ")".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def documents():
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CHANGELOG.md"),
             os.path.join(ROOT, "bench", "results", "README.md")]
    paths += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [path for path in paths if os.path.isfile(path)]


def tracked_files():
    """The repository's tracked files (relative paths), or None outside a git checkout (a copy
    without .git: then a link must name a file that exists)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {os.path.normpath(name) for name in listed.decode().split("\0") if name}


def prose(text):
    """The text with fenced blocks and code spans blanked: a link inside code is not a link."""
    text = FENCE.sub("", text)
    return CODE_SPAN.sub("", text)


def anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    heading = CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading)
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(path):
    with open(path, encoding="utf-8") as file:
        return {anchor(heading) for heading in HEADING.findall(FENCE.sub("", file.read()))}


def links(path):
    with open(path, encoding="utf-8") as file:
        return LINK.findall(prose(file.read()))


class DocsLinks(unittest.TestCase):
    def test_the_link_pattern_finds_links_and_skips_code(self):
        text = ("see [usage](docs/usage.md#limits) and ![plot](a.png \"title\")\n"
                "`[not](a link)` and\n```\n[nor](this)\n```\n[x](<b c.md>)")
        self.assertEqual(LINK.findall(prose(text)), ["docs/usage.md#limits", "a.png"])
        self.assertEqual(anchor("Quickstart: torch.compile passes"),
                         "quickstart-torchcompile-passes")
        self.assertEqual(anchor("The GPU check: scripts/gpu-check.sh"),
                         "the-gpu-check-scriptsgpu-checksh")

    def test_every_relative_link_names_a_tracked_file(self):
        tracked = tracked_files()
        checked, broken = 0, []
        for document in documents():
            where = os.path.relpath(document, ROOT)
            for target in links(document):
                if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, section = target.partition("#")
                if path:
                    resolved = os.path.normpath(os.path.join(os.path.dirname(document), path))
                else:
                    resolved = document
                relative = os.path.relpath(resolved, ROOT)
                checked += 1
                if relative.startswith(".."):
                    broken.append(f"{where}: {target} leaves the repository")
                elif tracked is not None and relative not in tracked and not any(
                        name.startswith(relative + os.sep) for name in tracked):
                    broken.append(f"{where}: {target} is not a tracked file ({relative})")
                elif tracked is None and not os.path.exists(resolved):
                    broken.append(f"{where}: {target} does not exist ({relative})")
                elif section and resolved.endswith(".md") and os.path.isfile(resolved) and \
                        section not in anchors(resolved):
                    broken.append(f"{where}: {target}: no heading #{section} in {relative}")
        self.assertGreater(checked, 0, "no relative links found: the pattern is wrong")
        self.assertEqual(broken, [], "\n" + "\n".join(broken))


if __name__ == "__main__":
    unittest.main()
