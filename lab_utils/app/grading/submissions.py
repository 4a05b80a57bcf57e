"""Finding the handed-in notebooks: folders, zip files, LMS file names, the roster.

The layouts read (student folders, ``<student>.ipynb``, Canvas and Moodle export names, zips): README,
"Instructor: exercises and grading", step 2. A student's ``handin.json`` becomes a ``kind="handin"``
submission (read by :mod:`lab_utils.app.grading.provenance`); a file that is not a notebook (a PDF in a
Canvas download) a ``kind="other"`` one, listed in the student's row; a file of a student's own folder
other than a notebook (the written report, its figures) is not listed. Which lab notebook a file is
comes from its metadata (:mod:`lab_utils.app.grading.grade`), not from here.
"""

from __future__ import annotations

import csv
import os
import re
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from lab_utils.learn.errors import LabError

CANVAS = re.compile(r"^(?P<name>[a-z0-9-]+?)(?:_late)?_(?P<uid>\d+)_(?P<sid>\d+)_(?P<rest>.+)$", re.I)
MOODLE = re.compile(r"^(?P<name>.+?)_(?P<uid>\d+)_assignsubmission_[a-z]+_?(?P<rest>.*)$", re.I)
RESUBMISSION = re.compile(r"-(\d+)$")
MAX_MEMBER_BYTES = 50_000_000
MAX_ZIP_BYTES = 1_000_000_000
MAX_ZIP_MEMBERS = 5_000
HANDIN = re.compile(r"^handin(-\d+)?\.json$")   # make report's handin.json (an LMS resubmission: -1, -2)


def normalize(name: str) -> str:
    """A name as a key: lower case, letters and digits only ("Doe, Jane" -> "doejane")."""
    return re.sub(r"[^0-9a-z]", "", name.lower())


def same_name(a: str, b: str) -> bool:
    """Whether two spellings name the same person: "Doe, Jane", "Jane Doe", "doejane" (Canvas)."""
    words = [sorted(re.findall(r"[0-9a-z]+", x.lower())) for x in (a, b)]
    return bool(normalize(a)) and (normalize(a) == normalize(b) or words[0] == words[1])


@dataclass
class Student:
    name: str
    id: str = ""

    @property
    def key(self) -> str:
        return f"id:{self.id}" if self.id else f"name:{normalize(self.name) or self.name}"


@dataclass
class Submission:
    student: Student
    path: Path            # a file on disk (a zip member is unpacked into a staging folder)
    file: str             # as handed in, relative to the submissions folder ("a.zip!04_x.ipynb")
    original: str         # the file name the student gave it (LMS prefix removed)
    mtime: float
    resubmission: int = 0
    problem: str = ""     # why it cannot be graded at all ("" = a notebook to grade)
    kind: str = "notebook"   # "notebook"; "handin": a handin.json; "other": a file not graded (a PDF)


def parse_lms(name: str) -> tuple[Student | None, str]:
    """(student, original file name) from an LMS-exported name, or (None, name)."""
    for pattern in (CANVAS, MOODLE):
        m = pattern.match(name)
        if m:
            return Student(m.group("name"), m.group("uid")), m.group("rest") or ""
    return None, name


def is_handin(original: str) -> bool:
    """Whether a file (its name as the student gave it) is ``make report``'s ``handin.json``."""
    return bool(HANDIN.match(Path(original).name))


def _resubmission(original: str) -> int:
    m = RESUBMISSION.search(Path(original).stem)
    return int(m.group(1)) if m else 0


@dataclass
class Unpacked:
    """What a zip holds: notebooks and zips unpacked (path on disk, shown name, date), other files
    named only (member, shown name), and members that cannot be used (member, shown name, why)."""
    found: list[tuple[Path, str, float]]
    others: list[tuple[str, str]]
    problems: list[tuple[str, str, str]]


def _unpack(zip_path: Path, dest: Path, shown: str, keep_paths: bool = False) -> Unpacked:
    """The ``.ipynb`` and ``.zip`` members of a zip, unpacked into ``dest`` (``keep_paths``: keep the
    members' folders, sanitized: no absolute path, no ``..``; else one folder per member)."""
    out = Unpacked([], [], [])
    total = 0
    try:
        zf = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as e:
        out.problems.append(("", shown, f"not a readable zip file ({e})"))
        return out
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_ZIP_MEMBERS:
            out.problems.append(("", shown, f"{len(infos)} files in the zip, more than {MAX_ZIP_MEMBERS}"))
            return out
        for i, info in enumerate(infos):
            member = info.filename
            if info.is_dir() or "__MACOSX" in member or Path(member).name.startswith("."):
                continue
            if not member.endswith((".ipynb", ".zip")) and not is_handin(parse_lms(Path(member).name)[1]):
                out.others.append((member, f"{shown}!{member}"))
                continue
            if info.file_size > MAX_MEMBER_BYTES or total + info.file_size > MAX_ZIP_BYTES:
                out.problems.append((member, f"{shown}!{member}",
                                     f"too large ({info.file_size / 1e6:.0f} MB; the limit is "
                                     f"{MAX_MEMBER_BYTES / 1e6:.0f} MB: clear its outputs)"))
                continue
            total += info.file_size
            parts = _parts(member)
            target = dest / Path(*parts) if keep_paths and parts else dest / f"{i:04d}" / Path(member).name
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as f:
                f.write(src.read(MAX_MEMBER_BYTES + 1))
            mtime = time.mktime(info.date_time + (0, 0, -1))
            os.utime(target, (mtime, mtime))   # "the latest wins" compares the zip's dates
            out.found.append((target, f"{shown}!{member}", mtime))
    return out


def _parts(member: str) -> list[str]:
    return [p for p in Path(member).parts if p not in ("", ".", "..", "/") and not p.endswith(":")]


def member_owner(member: str, fallback: Student | None, in_folders: bool = False) -> Student:
    """Whose a zip member is: the student its LMS name names (a Canvas bulk download), else (in a zip
    of student folders) its folder's, else the zip's owner, else its own name's."""
    parts = _parts(member) or [member]
    lms, _ = parse_lms(parts[-1])
    if lms:
        return lms
    if in_folders and len(parts) > 1:
        return parse_lms(parts[0])[0] or Student(parts[0])
    return fallback or Student(Path(parts[-1]).stem)


def find_submissions(root: Path, staging: Path) -> list[Submission]:
    """Every handed-in file under ``root`` (a folder or a zip file), zips unpacked into ``staging``.

    Files that are not notebooks become ``kind="other"`` submissions; a zip or member that cannot be
    used becomes a submission whose ``problem`` says why.
    """
    root = Path(root)
    out: list[Submission] = []

    def unpacked(z: Unpacked, zip_path: Path, owner: Student | None, mtime: float, in_folders: bool) -> None:
        for member, shown, why in z.problems:
            who = member_owner(member, owner, in_folders) if member else owner or Student(zip_path.stem)
            out.append(Submission(who, zip_path, shown, Path(member).name, mtime, problem=why))
        for member, shown in z.others:
            out.append(Submission(member_owner(member, owner, in_folders), zip_path, shown, Path(member).name,
                                  mtime, kind="other"))

    def add(path: Path, shown: str, mtime: float, owner: Student | None, depth: int = 0) -> None:
        lms, original = parse_lms(Path(shown.split("!")[-1]).name)
        student = lms or owner or Student(Path(original).stem)
        if path.suffix == ".zip" and depth < 2:
            z = _unpack(path, staging / f"z{len(out):05d}_{depth}", shown)
            unpacked(z, path, student, mtime, False)
            for m_path, m_shown, m_mtime in z.found:
                add(m_path, m_shown, m_mtime, student, depth + 1)
            return
        kind = "notebook" if path.suffix == ".ipynb" else "handin" if is_handin(original) else "other"
        out.append(Submission(student, path, shown, original, mtime, _resubmission(original), kind=kind))

    prefix = ""
    if root.is_file():
        if root.suffix != ".zip":
            raise LabError(f"{root} is neither a folder of submissions nor a zip file of them.")
        z = _unpack(root, staging / "root", root.name, keep_paths=True)
        if z.problems and not z.found and not z.problems[0][0]:
            raise LabError(f"{root}: {z.problems[0][2]}.")
        unpacked(z, root, None, root.stat().st_mtime, True)
        root, prefix = staging / "root", root.name + "!"
    for entry in sorted(root.iterdir()):
        if entry.name.startswith((".", "_")):
            continue
        if entry.is_dir():
            lms, _ = parse_lms(entry.name)
            owner = lms or Student(entry.name)
            files = sorted(p for p in entry.rglob("*") if p.is_file() and ".ipynb_checkpoints" not in p.parts
                           and not p.name.startswith("."))
            # A student's folder may also hold the written report and its figures (docs/grading.md,
            # "Handing in"): only notebooks and zips are graded; the rest is the
            # instructor's to read, and is a problem only when the folder holds nothing to grade.
            gradable = [p for p in files if p.suffix in (".ipynb", ".zip") or is_handin(p.name)]
            if not any(p.suffix in (".ipynb", ".zip") for p in gradable):
                others = ", ".join(p.name for p in files[:4]) or "empty"
                out.append(Submission(owner, entry, prefix + entry.name + "/", "", entry.stat().st_mtime,
                                      problem=f"no notebook in the folder ({others})"))
            for p in gradable:
                add(p, prefix + str(p.relative_to(root)), p.stat().st_mtime, owner)
        else:
            add(entry, prefix + entry.name, entry.stat().st_mtime, None)
    return out


@dataclass
class Roster:
    students: list[Student]

    def match(self, s: Student) -> Student | None:
        """The roster's entry for a student found in the submissions (by id, else by name)."""
        if s.id:
            hit = next((r for r in self.students if r.id and r.id == s.id), None)
            if hit:
                return hit
        return next((r for r in self.students if same_name(r.name, s.name)), None)


ID_COLUMNS = ("id", "student id", "student_id", "sis user id", "id number", "user id", "login id",
              "sis login id")
NAME_COLUMNS = ("student", "name", "student name", "full name", "sortable name", "login")


def read_roster(path: Path) -> Roster:
    """A CSV with a header: an id column (``id``, ``SIS User ID``, ``ID number``...) and/or a name
    column (``student``, ``name``...; or ``First name`` + ``Last name``)."""
    path = Path(path)
    if not path.is_file():
        raise LabError(f"No roster at {path}: give a CSV with a header, e.g. 'student,id'.")
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise LabError(f"The roster {path} has no students (a header line, then one line per student).")
    cols = {c.strip().lower(): c for c in rows[0] if c}
    id_col = next((cols[c] for c in ID_COLUMNS if c in cols), None)
    name_col = next((cols[c] for c in NAME_COLUMNS if c in cols), None)
    first, last = cols.get("first name"), cols.get("last name")
    if not (id_col or name_col or (first and last)):
        raise LabError(f"The roster {path} needs a column named 'student' (or 'name') or 'id'; it has "
                       f"{', '.join(rows[0])}.")
    students = []
    for r in rows:
        name = (r.get(name_col) if name_col else f"{r.get(first, '')} {r.get(last, '')}") or ""
        name = name.strip()
        sid = (r.get(id_col) or "").strip() if id_col else ""
        if name or sid:
            students.append(Student(name or sid, sid))
    return Roster(students)
