"""The docs and comments describe the current state: no work-session diary in the code, no
reference to a design file that does not exist, and a benchmarks page of current results
in which every table section says how it was measured and on what."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIARY = re.compile(r"\b(sessions?|rounds?|issue) [0-9]+", re.IGNORECASE)
MISSING_DESIGN_FILE = "DESIGN" + ".md"          # split so this file does not name it
COMMAND = re.compile(r"^(```|    (python|python3|mtpjax|for |XLA_|MTPJAX_)|Command:)", re.MULTILINE)
DEVICE = re.compile(r"\b(H100|H200|nvidia-h\d+)|Device:")


def _files(top, suffixes):
    for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        for name in names:
            if name.endswith(suffixes):
                yield os.path.join(folder, name)


def _hits(pattern, paths):
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if pattern(line):
                    out.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()[:100]}")
    return out


def test_code_holds_no_session_or_round_numbers():
    """Comments say why; when a change was measured belongs to git and docs/history."""
    paths = [p for top in ("mtpjax", "pallas_kernels", "tests") for p in _files(top, (".py",))
             if os.path.abspath(p) != os.path.abspath(__file__)]
    assert len(paths) > 50
    assert _hits(DIARY.search, paths) == []


def test_diary_pattern_catches_what_it_should():
    # joined at run time, so this file itself passes a plain grep for the diary words
    for words in (("round", "3", "session", "22"), ("(Session", "7)"), ("issue", "12's target"),
                  ("sessions", "27-28")):
        assert DIARY.search(" ".join(words)), words
    for words in (("norms aro" + "und", "1"), ("rounds up to", "8"), ("vLLM", "#18902"),
                  ("MUFU issues", "4 lanes")):
        assert not DIARY.search(" ".join(words)), words


def test_no_reference_to_a_missing_design_file():
    assert not os.path.exists(os.path.join(ROOT, MISSING_DESIGN_FILE))
    paths = [os.path.join(ROOT, "README.md")]
    for top, suffixes in (("docs", (".md",)), ("notebooks", (".ipynb",)),
                          ("mtpjax", (".py", ".md")), ("pallas_kernels", (".py",)),
                          ("tests", (".py",))):
        paths += [p for p in _files(top, suffixes) if os.path.abspath(p) != os.path.abspath(__file__)]
    assert _hits(lambda line: MISSING_DESIGN_FILE in line, paths) == []


def _sections(text):
    """{title: body} of the page's "## " sections."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_benchmarks_page_is_short_and_every_section_names_command_and_device():
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) < 320
    sections = _sections(text)
    assert len(sections) >= 5
    for title, body in sections.items():
        if "|---" not in body:
            continue                                    # a section without a table
        assert COMMAND.search(body), f"section {title!r} names no command"
        assert DEVICE.search(body), f"section {title!r} names no device"
        assert re.search(r"commit [0-9a-f]{7}|commit not recorded", body), \
            f"section {title!r} names no commit"


def test_benchmark_history_notes_are_dated_and_say_they_are_superseded():
    folder = os.path.join(ROOT, "docs", "history")
    names = sorted(os.listdir(folder))
    assert names
    for name in names:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", name), name
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            head = f.read(2000)
        assert "superseded" in head and "docs/" in head, name
