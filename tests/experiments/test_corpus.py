"""The ``lm`` task's corpus: the standard library's fixed subset, the held-out split by
file name, ``--corpus`` files and folders, and the errors."""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import pytest

from posenc.experiments.corpus import is_held_out, load_corpus, stdlib_files


def held(name: str) -> bool:
    """The split rule, written out: one name in five by its CRC-32."""
    return zlib.crc32(name.encode("utf-8")) % 5 == 0


def names_on(side: bool, count: int, prefix: str = "f") -> list[str]:
    """``count`` file names that the rule puts on ``side`` (True: held out)."""
    found = []
    i = 0
    while len(found) < count:
        name = f"{prefix}{i}.txt"
        if held(name) == side:
            found.append(name)
        i += 1
    return found


def test_the_split_rule_is_the_crc32_of_the_name():
    for name in ("argparse.py", "ast.py", "bisect.py", "os.py", "a/b.txt"):
        assert is_held_out(name) == held(name)
    assert is_held_out("argparse.py") and not is_held_out("ast.py")


def test_stdlib_is_the_sorted_public_top_level_modules():
    root, files = stdlib_files()
    assert root == Path(sysconfig.get_paths()["stdlib"])
    names = [p.name for p in files]
    expected = sorted(
        p.name for p in root.glob("*.py") if not p.name.startswith("_") and p.is_file()
    )
    assert names == expected and len(names) > 50
    assert "os.py" in names and not any(n.startswith("_sysconfigdata") for n in names)


def test_stdlib_corpus_is_a_fixed_subset_split_by_name():
    corpus = load_corpus(None, train_bytes=50_000, held_out_bytes=20_000)
    assert corpus.source == "stdlib" and corpus.split == "files"
    assert corpus.train.numel() == 50_000 and corpus.held_out.numel() == 20_000
    assert not set(corpus.train_files) & set(corpus.held_out_files)
    assert all(not held(n) for n in corpus.train_files)
    assert all(held(n) for n in corpus.held_out_files)
    _, files = stdlib_files()
    # the training text: the training files in sorted order, concatenated, cut at the budget
    kept = [p for p in files if not held(p.name)]
    expected = b"".join(p.read_bytes() for p in kept[: len(corpus.train_files)])[:50_000]
    assert bytes(corpus.train.tolist()) == expected
    assert list(corpus.train_files) == [p.name for p in kept[: len(corpus.train_files)]]
    first_held = next(p for p in files if held(p.name))
    assert corpus.held_out_files[0] == first_held.name
    assert bytes(corpus.held_out[:1000].tolist()) == first_held.read_bytes()[:1000]
    assert load_corpus(None, train_bytes=50_000, held_out_bytes=20_000) is corpus  # cached
    record = corpus.describe()
    assert record["train_bytes"] == 50_000 and record["held_out_files"] == list(
        corpus.held_out_files
    )


def test_a_folder_is_split_by_file_and_hidden_files_are_left_out(tmp_path):
    train_names, held_names = names_on(False, 3), names_on(True, 2)
    for name in train_names + held_names:
        (tmp_path / name).write_text(f"<{name}> text\n", encoding="utf-8")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_bytes(b"\xff\xfe binary")  # hidden: never read
    (tmp_path / ".hidden.txt").write_text("hidden\n")
    corpus = load_corpus(str(tmp_path))
    assert corpus.split == "files" and corpus.source == str(tmp_path)
    assert list(corpus.train_files) == sorted(train_names)
    assert list(corpus.held_out_files) == sorted(held_names)
    assert bytes(corpus.train.tolist()) == b"".join(
        f"<{n}> text\n".encode() for n in sorted(train_names)
    )
    assert bytes(corpus.held_out.tolist()) == b"".join(
        f"<{n}> text\n".encode() for n in sorted(held_names)
    )


def test_a_subfolder_file_is_named_by_its_relative_path(tmp_path):
    (tmp_path / "sub").mkdir()
    name = next(n for n in (f"sub/g{i}.txt" for i in range(100)) if held(n))
    (tmp_path / name).write_text("held out\n")
    for other in names_on(False, 2):
        (tmp_path / other).write_text("train\n")
    corpus = load_corpus(str(tmp_path))
    assert corpus.held_out_files == (name,)


def test_one_file_holds_out_its_last_tenth(tmp_path):
    path = tmp_path / "book.txt"
    text = "".join(f"line {i} é\n" for i in range(100)).encode("utf-8")
    path.write_bytes(text)
    corpus = load_corpus(str(path))
    assert corpus.split == "tail"
    cut = len(text) - int(len(text) * 0.1)
    assert bytes(corpus.train.tolist()) == text[:cut]
    assert bytes(corpus.held_out.tolist()) == text[cut:]
    assert corpus.train_files == corpus.held_out_files == ("book.txt",)


def test_the_tail_split_names_the_files_on_each_side(tmp_path):
    names = names_on(False, 2)  # all on the training side: split by position
    (tmp_path / names[0]).write_text("a" * 95)
    (tmp_path / names[1]).write_text("b" * 5)
    corpus = load_corpus(str(tmp_path))
    assert corpus.split == "tail" and corpus.held_out.numel() == 10
    assert corpus.train_files == (names[0],) and corpus.held_out_files == tuple(names)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing", None, r"corpus '.*missing' is not a file or a folder"),
        ("empty.txt", "", r"holds no text \(1 file\(s\), all empty\)"),
        ("", None, r"holds no text \(0 file\(s\)"),  # an empty folder
        ("short.txt", "abc", r"holds too little text \(3 bytes in 1 file\(s\)\)"),
    ],
)
def test_a_corpus_without_text_is_an_error(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        load_corpus(str(tmp_path / name))


def test_a_file_that_is_not_utf8_is_an_error_naming_it(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"corpus file .*latin1.txt is not UTF-8 text .*byte 3"):
        load_corpus(str(tmp_path / "latin1.txt"))
    (tmp_path / "good.txt").write_text("fine\n" * 50)
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 text"):
        load_corpus(str(tmp_path))  # in a folder too


@pytest.mark.parametrize("budget", ["train_bytes", "held_out_bytes"])
def test_budgets_are_checked(budget):
    with pytest.raises(ValueError, match=f"{budget} must be >= 1, got 0"):
        load_corpus(None, **{budget: 0})
