"""The manual cannot rot silently: in README.md, docs/ and the READMEs beside the code, every
relative link leads to a file (and a heading, when it names one), every `make` target named is
in the Makefile, every repository path named in backticks exists, and every flag the command-line
page lists is one the binary takes."""
import glob
import os
import re
import subprocess

import pytest

from conftest import BINARY, ROOT

PAGES = sorted(
    [os.path.join(ROOT, "README.md")]
    + glob.glob(os.path.join(ROOT, "docs", "*.md"))
    + [os.path.join(ROOT, p) for p in ("host/README.md", "python/README.md", "guest-sdk/README.md",
                                        "examples/README.md", "docker/README.md",
                                        "deploy/ray/README.md", "benches/README.md")
       if os.path.exists(os.path.join(ROOT, p))])
TOP = ("host/", "docs/", "tests/", "benches/", "scripts/", "deploy/", "docker/", "examples/",
       "guest-sdk/", "python/", "wit/", "model_repository/", "tools/", "fuzz/")


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    with open(path, encoding="utf-8") as f:
        return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", f.read(), re.M)}


def text_of(page):
    with open(page, encoding="utf-8") as f:
        return f.read()


def without_code_blocks(text):
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_lead_somewhere(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code_blocks(text_of(page))):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(dest):
            broken.append(target)
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, broken


def make_targets():
    with open(os.path.join(ROOT, "Makefile")) as f:
        return set(re.findall(r"^([a-zA-Z][\w.-]*):", f.read(), re.M))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_make_targets_and_paths_named_exist(page):
    text = text_of(page)
    targets = make_targets()
    # `make a b` in the text, and `make …` lines of shell blocks.
    commands = re.findall(r"`make ([^`]+)`", text) + re.findall(r"^\s*make ([^#\n]+)", text, re.M)
    unknown = sorted({word for command in commands for word in command.split()
                      if re.fullmatch(r"[a-z][\w-]*", word) and word not in targets})
    assert not unknown, unknown
    if page.endswith(os.path.join("benches", "README.md")):
        return  # a log of past runs: it names files those runs made
    missing = []
    for span in re.findall(r"`([^`\s]+)`", text):
        path = span.rstrip(".,:;)")
        if not path.startswith(TOP) or re.search(r"[<>*{}$|…]|\.\.\.", path):
            continue
        path = path.split("#")[0].split(":")[0]
        # Repository paths, or paths beside the page (a folder's README names its own files).
        if not any(os.path.exists(os.path.join(base, path))
                   for base in (ROOT, os.path.dirname(page))):
            missing.append(path)
    assert not missing, sorted(set(missing))


def test_every_flag_the_command_line_page_lists_is_taken():
    help_text = subprocess.run([BINARY, "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    with open(os.path.join(ROOT, "host", "src", "command_line", "triton_only.rs")) as f:
        triton_only = f.read()
    page = text_of(os.path.join(ROOT, "docs", "command-line.md"))
    flags = set()
    for row in page.splitlines():
        if row.startswith("| `--"):
            flags.update(re.findall(r"`(--[a-z0-9-]+)", row.split(" | ")[0]))
    assert len(flags) > 50, flags
    unknown = sorted(f for f in flags
                     if f not in help_text and f'"{f[2:]}"' not in triton_only)
    assert not unknown, unknown
