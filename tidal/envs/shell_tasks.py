"""Tasks of the `shell` environment: a starting workspace, a goal in words, and the checks that
decide from the final workspace whether the goal was reached.

Ten families, each parametrized by names, contents and numbers drawn from a seed:

| family | the goal |
| --- | --- |
| create_file | create a file (and its directory) holding one given line |
| move_files | move every file of one extension into a new directory, leave the others |
| find_word | find the one file under a tree that contains a word, write its path |
| edit_config | change one value in a config file, every other line unchanged |
| fix_script | fix a small Python script with a bug so it prints the right answer (checked on hidden input too) |
| count_matches | count the lines of a log that contain a level, write the number |
| delete_files | delete the files of one extension under a tree, keep the rest |
| copy_backup | copy a file to a backup path in a new directory, keep the original |
| sort_lines | write the sorted lines of a file into another |
| make_executable | make a script executable so that running it prints its word |

A task is a row: `prompt`, `task_id`, `family`, `files` (the starting workspace: path, content,
executable), `checks` (JSON text: what the verifier tests) and `solution` (reference shell
commands that reach the goal; tests run them). The policy sees only the prompt and the files.
The held-out split is a hash bucket of the task's content (one in five), so train and
held-out never share a task whatever the seeds and sizes.

The verifier is `CHECKER`, a Python script run after the episode (tidal.envs.shell) on a
snapshot of the final workspace, in a fresh sandbox. Check kinds: `file` (a regular file whose text equals `content`, trailing
whitespace of lines and trailing blank lines aside), `answer` (a file whose stripped text,
less a leading `./` or workspace path, equals `value`), `absent`, `executable`, and `run`
(run `argv` in the workspace, `python` meaning the sandbox's interpreter, with optional
hidden `input` files in a fresh directory named by `{input}`; stdout must equal `stdout`).
"""

from __future__ import annotations

import hashlib
import json
import random
import shlex
from collections.abc import Callable
from typing import Any

HELD_OUT_BUCKETS = 5

WORDS = ["amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "iris", "juniper", "kelp",
         "lumen", "maple", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "violet",
         "willow", "yarrow", "zephyr", "acorn", "birch", "comet", "dune", "falcon", "glacier", "heron", "lotus",
         "meadow", "nova", "orchid", "pebble", "ripple", "sierra", "thistle"]
SECRETS = ["xylophone", "quokka", "zeppelin", "kumquat", "marzipan", "obsidian", "pangolin", "sphinx",
           "tamarind", "vortex", "wombat", "yodel"]
DIRS = ["notes", "docs", "reports", "work", "inbox", "drafts", "data", "misc", "projects", "archive"]
VERBS = ["water", "paint", "call", "email", "fix", "buy", "check", "clean", "plan", "review"]
NOUNS = ["plants", "fence", "printer", "invoices", "tickets", "bikes", "lamps", "notes", "boxes", "keys"]
EXTS = ["log", "csv", "txt", "md", "json", "tmp", "bak", "dat"]
CONFIG_KEYS = {"port": lambda r: str(r.randint(1024, 9999)), "host": lambda r: r.choice(["localhost", "0.0.0.0", "db.internal", "cache.local"]),
               "workers": lambda r: str(r.randint(1, 32)), "timeout": lambda r: str(r.randint(5, 120)),
               "mode": lambda r: r.choice(["fast", "safe", "debug", "batch"]), "level": lambda r: r.choice(["info", "warn", "error", "debug"]),
               "retries": lambda r: str(r.randint(0, 9)), "user": lambda r: r.choice(WORDS), "cache_mb": lambda r: str(r.randint(16, 4096))}
LEVELS = ["INFO", "WARN", "ERROR", "DEBUG"]
MESSAGES = ["disk usage high", "request served", "connection reset", "cache miss", "user login", "job finished",
            "retrying upload", "config reloaded", "slow query", "timeout waiting for lock"]


q = shlex.quote


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _file(path: str, content: str, executable: bool = False) -> dict[str, Any]:
    return {"path": path, "content": content, "executable": executable}


def _distinct(rng: random.Random, pool: list[str], n: int) -> list[str]:
    return rng.sample(pool, n)


# -- families: each returns (prompt, files, checks, reference solution as shell commands) ----

def create_file(rng: random.Random):
    d, name = rng.choice(DIRS), rng.choice(WORDS)
    line = f"{rng.choice(VERBS)} the {rng.randint(2, 99)} {rng.choice(NOUNS)}"
    path = f"{d}/{name}.txt"
    files = [_file("README.txt", f"workspace of {rng.choice(WORDS)}\n")]
    prompt = f"Create the file `{path}` (and its directory) containing exactly one line: `{line}`"
    return prompt, files, [{"kind": "file", "path": path, "content": line}], [f"mkdir -p {d} && echo {q(line)} > {path}"]


def move_files(rng: random.Random):
    src, year = rng.choice(DIRS), rng.randint(2015, 2029)
    dst = f"{rng.choice(['archive', 'old', 'backup', 'done'])}/{year}"
    ext, other = rng.sample(EXTS, 2)
    names = _distinct(rng, WORDS, rng.randint(4, 6))
    n_move = rng.randint(2, len(names) - 2)
    files, checks = [], []
    for i, name in enumerate(names):
        e = ext if i < n_move else other
        content = f"{name} {_words(rng, 4)}\n"
        files.append(_file(f"{src}/{name}.{e}", content))
        if e == ext:
            checks += [{"kind": "file", "path": f"{dst}/{name}.{e}", "content": content},
                       {"kind": "absent", "path": f"{src}/{name}.{e}"}]
        else:
            checks.append({"kind": "file", "path": f"{src}/{name}.{e}", "content": content})
    rng.shuffle(files)
    prompt = (f"Move every `.{ext}` file in `{src}/` into the new directory `{dst}/` (keep the file names). "
              f"Leave the other files in `{src}/` where they are.")
    return prompt, files, checks, [f"mkdir -p {dst} && mv {src}/*.{ext} {dst}/"]


def find_word(rng: random.Random):
    root = rng.choice(DIRS)
    secret = rng.choice(SECRETS)
    paths = sorted({f"{root}/{rng.choice(WORDS)}/{rng.choice(WORDS)}.txt" for _ in range(rng.randint(5, 8))})
    target = rng.choice(paths)
    files = []
    for p in paths:
        lines = [_words(rng, rng.randint(3, 7)) for _ in range(rng.randint(2, 5))]
        if p == target:
            i = rng.randrange(len(lines))
            words = lines[i].split()
            words.insert(rng.randrange(len(words) + 1), secret)
            lines[i] = " ".join(words)
        files.append(_file(p, "\n".join(lines) + "\n"))
    prompt = (f"Exactly one file under `{root}/` contains the word `{secret}`. Write the path of that file, "
              f"relative to the workspace (like `{root}/x/y.txt`), into the file `answer.txt`.")
    return prompt, files, [{"kind": "answer", "path": "answer.txt", "value": target}], [f"grep -rlw {secret} {root} > answer.txt"]


def edit_config(rng: random.Random):
    app = rng.choice(WORDS)
    path = rng.choice([f"{app}.ini", f"config/{app}.conf", f"etc/{app}.cfg"])
    keys = rng.sample(sorted(CONFIG_KEYS), rng.randint(4, 6))
    values = {k: CONFIG_KEYS[k](rng) for k in keys}
    key = rng.choice(keys)
    new = CONFIG_KEYS[key](rng)
    while new == values[key]:
        new = CONFIG_KEYS[key](rng)
    before = [f"# {app} settings"] + [f"{k} = {values[k]}" for k in keys]
    after = [f"{key} = {new}" if line == f"{key} = {values[key]}" else line for line in before]
    prompt = (f"In `{path}`, change the value of `{key}` from `{values[key]}` to `{new}`. "
              "Leave every other line as it is.")
    return (prompt, [_file(path, "\n".join(before) + "\n")], [{"kind": "file", "path": path, "content": "\n".join(after)}],
            [f"sed -i {q(f's/^{key} = .*$/{key} = {new}/')} {path}"])


# fix_script programs: (what it prints, correct body, buggy body, data maker, answer of the data)
def _ints(rng: random.Random, negative: bool = False) -> list[int]:
    lo, hi = (-99, -1) if negative else (-20, 99)
    return [rng.randint(lo, hi) for _ in range(rng.randint(5, 9))]


_READ = "import sys\n\nlines = open(sys.argv[1]).read().splitlines()\n"
PROGRAMS: dict[str, tuple[str, str, str, Callable[[random.Random, bool], str], Callable[[str], str]]] = {
    "sum": ("the sum of the numbers in the file (one per line)",
            _READ + "total = 0\nfor line in lines:\n    total += int(line)\nprint(total)\n",
            _READ + "total = 0\nfor line in lines[1:]:\n    total += int(line)\nprint(total)\n",
            lambda r, hidden: "\n".join(map(str, _ints(r))) + "\n",
            lambda data: str(sum(int(x) for x in data.split()))),
    "max": ("the largest number in the file (one per line)",
            _READ + "best = None\nfor line in lines:\n    if best is None or int(line) > best:\n        best = int(line)\nprint(best)\n",
            _READ + "best = 0\nfor line in lines:\n    if int(line) > best:\n        best = int(line)\nprint(best)\n",
            lambda r, hidden: "\n".join(map(str, _ints(r, negative=True))) + "\n",
            lambda data: str(max(int(x) for x in data.split()))),
    "count": ("how many lines of the file contain the word `error`",
              _READ + "count = 0\nfor line in lines:\n    if 'error' in line.split():\n        count += 1\nprint(count)\n",
              _READ + "count = 0\nfor line in lines:\n    if 'error' in line.split():\n        count = 1\nprint(count)\n",
              lambda r, hidden: "\n".join(" ".join(r.sample(WORDS, 3) + (["error"] if i % 3 != 1 else []))
                                          for i in range(r.randint(5, 9))) + "\n",
              lambda data: str(sum("error" in line.split() for line in data.splitlines()))),
    "mean": ("the mean of the numbers in the file (one per line), rounded to 2 decimals",
             _READ + "nums = [int(x) for x in lines]\nprint(round(sum(nums) / len(nums), 2))\n",
             _READ + "nums = [int(x) for x in lines]\nprint(round(sum(nums) // len(nums), 2))\n",
             lambda r, hidden: "\n".join(map(str, _ints(r) + [1, 2])) + "\n",
             lambda data: str(round(sum(int(x) for x in data.split()) / len(data.split()), 2))),
    "words": ("the number of words in the file (words are separated by any whitespace)",
              "import sys\n\ntext = open(sys.argv[1]).read()\nprint(len(text.split()))\n",
              "import sys\n\ntext = open(sys.argv[1]).read()\nprint(len(text.split(' ')))\n",
              lambda r, hidden: "\n".join(_words(r, r.randint(2, 6)) for _ in range(r.randint(3, 6))) + "\n",
              lambda data: str(len(data.split()))),
    "longest": ("the longest line of the file (the first one if several are longest)",
                _READ + "best = ''\nfor line in lines:\n    if len(line) > len(best):\n        best = line\nprint(best)\n",
                _READ + "best = ''\nfor line in lines:\n    if len(line) < len(best):\n        best = line\nprint(best)\n",
                lambda r, hidden: "\n".join(_words(r, r.randint(1, 6)) for _ in range(r.randint(4, 7))) + "\n",
                lambda data: max(data.splitlines(), key=len)),
}


def fix_script(rng: random.Random):
    kind = rng.choice(sorted(PROGRAMS))
    what, fixed, buggy, make_data, answer = PROGRAMS[kind]
    script = f"{rng.choice(['stats', 'tally', 'report', 'summary', 'calc', 'tool'])}_{rng.choice(WORDS)}.py"
    data = f"{rng.choice(['data', 'input', 'numbers', 'values'])}.txt"
    content, hidden = make_data(rng, False), make_data(rng, True)
    while answer(hidden) == answer(content):
        hidden = make_data(rng, True)
    files = [_file(script, buggy), _file(data, content)]
    prompt = (f"The script `{script}` should print {what}, given the file as its argument: "
              f"`python {script} {data}`. It has a bug. Fix the script (it must work on other files too); "
              f"do not change `{data}`.")
    checks = [{"kind": "run", "argv": ["python", script, data], "stdout": answer(content)},
              {"kind": "run", "argv": ["python", script, "{input}/other.txt"], "input": {"other.txt": hidden},
               "stdout": answer(hidden)},
              {"kind": "file", "path": data, "content": content}]
    return prompt, files, checks, [f"printf %s {q(fixed)} > {script}", f"python {script} {data}"]


def count_matches(rng: random.Random):
    level = rng.choice(["ERROR", "WARN"])
    path = f"{rng.choice(['logs', 'var/log', 'output'])}/{rng.choice(WORDS)}.log"
    lines = [f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {rng.choice(LEVELS)} {rng.choice(MESSAGES)}"
             for _ in range(rng.randint(8, 20))]
    out = rng.choice(["count.txt", "answer.txt", f"{level.lower()}s.txt"])
    n = sum(level in line.split() for line in lines)
    prompt = f"Count the lines of `{path}` that contain `{level}` and write just that number into `{out}`."
    return (prompt, [_file(path, "\n".join(lines) + "\n")], [{"kind": "answer", "path": out, "value": str(n)}],
            [f"grep -cw {level} {path} > {out}"])


def delete_files(rng: random.Random):
    root = rng.choice(["build", "cache", "out", "tmp_work", "dist"])
    ext = rng.choice(["tmp", "o", "pyc", "bak", "swp"])
    keep_ext = rng.choice(["c", "txt", "py", "md", "h"])
    subdirs = ["", f"{rng.choice(WORDS)}/", f"{rng.choice(WORDS)}/{rng.choice(WORDS)}/"]
    files, checks, seen = [], [], set()
    for i in range(rng.randint(5, 8)):
        name = rng.choice(WORDS)
        e = ext if i % 2 == 0 else keep_ext
        path = f"{root}/{rng.choice(subdirs)}{name}.{e}"
        if path in seen:
            continue
        seen.add(path)
        content = f"{_words(rng, 3)}\n"
        files.append(_file(path, content))
        checks.append({"kind": "absent", "path": path} if e == ext else {"kind": "file", "path": path, "content": content})
    prompt = f"Delete every file whose name ends in `.{ext}` anywhere under `{root}/`. Keep all the other files."
    return prompt, files, checks, [f"find {root} -type f -name '*.{ext}' -delete"]


def copy_backup(rng: random.Random):
    name = rng.choice(WORDS)
    src = f"{rng.choice(['src', 'app', 'lib'])}/{name}.py"
    dst = f"{rng.choice(['backup', 'saved', 'snapshots'])}/{rng.randint(1, 31):02d}/{name}.py.bak"
    content = f"def {name}():\n    return {rng.randint(1, 999)!r}\n"
    prompt = f"Copy `{src}` to `{dst}` (create the directories as needed) and keep the original where it is."
    return (prompt, [_file(src, content)], [{"kind": "file", "path": src, "content": content},
                                            {"kind": "file", "path": dst, "content": content}],
            [f"mkdir -p {dst.rsplit('/', 1)[0]} && cp {src} {dst}"])


def sort_lines(rng: random.Random):
    src = f"{rng.choice(['names', 'guests', 'members', 'cities'])}.txt"
    out = rng.choice(["sorted.txt", "ordered.txt", f"sorted_{src}"])
    lines = [w.capitalize() for w in rng.sample(WORDS, rng.randint(5, 9))]
    prompt = (f"Write the lines of `{src}` in alphabetical order into `{out}`, one per line. "
              f"Keep `{src}` as it is.")
    checks = [{"kind": "file", "path": out, "content": "\n".join(sorted(lines))},
              {"kind": "file", "path": src, "content": "\n".join(lines)}]
    return prompt, [_file(src, "\n".join(lines) + "\n")], checks, [f"sort {src} > {out}"]


def make_executable(rng: random.Random):
    path = f"{rng.choice(['tools', 'bin', 'scripts'])}/{rng.choice(WORDS)}.sh"
    word = f"{rng.choice(WORDS)}-{rng.randint(10, 99)}"
    prompt = f"Make `{path}` executable, so that running `./{path}` prints `{word}`."
    checks = [{"kind": "executable", "path": path}, {"kind": "run", "argv": [f"./{path}"], "stdout": word}]
    return prompt, [_file(path, f"#!/bin/sh\necho {word}\n")], checks, [f"chmod +x {path}", f"./{path}"]


FAMILIES: dict[str, Callable[[random.Random], tuple[str, list[dict[str, Any]], list[dict[str, Any]], list[str]]]] = {
    f.__name__: f for f in (create_file, move_files, find_word, edit_config, fix_script, count_matches,
                            delete_files, copy_backup, sort_lines, make_executable)}


def task_digest(family: str, files: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps([family, files, checks], sort_keys=True).encode()).hexdigest()


def is_held_out(digest: str) -> bool:
    return int(digest[:8], 16) % HELD_OUT_BUCKETS == 0


def make_task(family: str, rng: random.Random) -> dict[str, Any]:
    """One task of `family` drawn with `rng`, as a row."""
    if family not in FAMILIES:
        raise ValueError(f"shell: unknown task family {family!r} (families: {', '.join(FAMILIES)})")
    prompt, files, checks, solution = FAMILIES[family](rng)
    digest = task_digest(family, files, checks)
    return {"prompt": prompt, "task_id": f"shell-{family}-{digest[:12]}", "family": family, "files": files,
            "checks": json.dumps(checks), "solution": solution}


def make_tasks(split: str, n: int, seed: int, families: list[str] | tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """`n` distinct tasks of `split` ("train" or "test"), the families taken in turn."""
    if split not in ("train", "test"):
        raise ValueError(f"shell: split must be 'train' or 'test', got {split!r}")
    families = list(families or FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"shell: unknown task families {unknown} (families: {', '.join(FAMILIES)})")
    rng = random.Random(f"shell-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(n * 60 + 1000):
        if len(rows) == n:
            break
        row = make_task(families[len(rows) % len(families)], rng)
        task_id = row["task_id"]
        if task_id in seen or is_held_out(task_id.rsplit("-", 1)[1]) != (split == "test"):
            continue
        seen.add(task_id)
        rows.append(row)
    if len(rows) < n:
        raise ValueError(f"shell: could only draw {len(rows)} distinct {split} tasks of {n} from families {families}")
    return rows


# The verifier, run as the main script of a fresh sandbox holding `snapshot.tar` (the final
# workspace, read out of the episode's session). stdin: {"token", "checks", "workspace"} (the
# session's own workspace path, which an `answer` may start with). It makes itself
# non-dumpable first, so the programs a `run` check starts (the policy's, same uid) can read
# neither its memory nor its /proc files, and prints `token {"passed", "total"}` last.
CHECKER = r"""
import ctypes, json, os, sys, tarfile
try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
except Exception:
    pass
spec = json.loads(sys.stdin.read())
token, checks, session_workspace = spec["token"], spec["checks"], spec["workspace"]
workspace = os.path.abspath("task")
os.makedirs(workspace)
with tarfile.open("snapshot.tar") as tar:
    try:
        tar.extractall(workspace, filter="tar")
    except TypeError:  # a Python without extraction filters (< 3.11.4)
        tar.extractall(workspace)
os.chdir(workspace)

def norm(text):
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)

def read(path):
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()

def run(check):
    import shutil, signal, subprocess, tempfile  # only tasks with a `run` check pay for these imports
    tmp = tempfile.mkdtemp() if check.get("input") else ""
    for name, content in (check.get("input") or {}).items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(content)
    argv = [sys.executable if a == "python" else a.replace("{input}", tmp) for a in check["argv"]]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workspace, "LANG": "C.UTF-8"}
    try:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                             env=env, start_new_session=True)
    except OSError:
        return False
    try:
        out, _ = p.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        out = None
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        p.wait()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return out is not None and p.returncode == 0 and norm(out.decode(errors="replace")) == norm(check["stdout"])

def passes(check):
    kind, path = check["kind"], check.get("path", "")
    if kind == "file":
        text = read(path)
        return text is not None and norm(text) == norm(check["content"])
    if kind == "answer":
        text = read(path)
        if text is None:
            return False
        value = text.strip()
        for prefix in (session_workspace.rstrip("/") + "/", "./"):
            value = value[len(prefix):] if value.startswith(prefix) else value
        return value == check["value"]
    if kind == "absent":
        return not os.path.lexists(path)
    if kind == "executable":
        return os.path.isfile(path) and os.access(path, os.X_OK)
    if kind == "run":
        return run(check)
    raise ValueError("unknown check kind " + repr(kind))

passed = 0
for check in checks:
    try:
        passed += bool(passes(check))
    except Exception:
        pass
print()
print(token, json.dumps({"passed": passed, "total": len(checks)}))
"""
