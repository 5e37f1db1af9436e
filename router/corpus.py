"""Labelled prompts for the domain classifier, assembled from honest sources.

Sources (see ``router/data/SOURCES.md`` for licences and the category map):

- ``spec_bench``: Spec-Bench questions (Apache-2.0), categories mapped to our
  domains by :data:`SPEC_BENCH_MAP`; multi-turn questions give one example per
  prefix of their turns.
- ``gsm8k``: GSM8K train problems (MIT) -> ``math``.
- ``stdlib``: code requests built from this interpreter's standard library:
  function signatures + docstrings phrased as "write/implement" requests, and
  real source snippets phrased as "explain/fix/test this" requests -> ``code``.
- ``template``: hand-written request templates (this project) for domains that
  the sources above cover thinly (chat, extraction, translation, summarization),
  filled only with passages from the *training* side of the split.

The split is by group, never by example: a Spec-Bench question id, a GSM8K row
or a stdlib module is either wholly in training or wholly held out, and the
held-out side contains no ``router.templates`` examples (stdlib requests on
both sides share the phrasing templates below).
"""

from __future__ import annotations

import inspect
import json
import logging
import random
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SPEC_BENCH_MAP = {
    "translation": "translation", "summarization": "summarization", "qa": "qa",
    "math_reasoning": "math", "math": "math", "reasoning": "math", "rag": "rag",
    "writing": "chat", "roleplay": "chat", "coding": "code", "extraction": "extraction",
    "stem": "qa", "humanities": "qa",
}

# Pure-Python stdlib modules whose docstrings read like function specs.
STDLIB_MODULES = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "copy", "csv",
    "dataclasses", "datetime", "difflib", "email.utils", "enum", "filecmp", "fnmatch",
    "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac",
    "html", "http.cookies", "imaplib", "inspect", "ipaddress", "json", "logging", "mailbox",
    "mimetypes", "netrc", "ntpath", "numbers", "operator", "optparse", "os", "pathlib",
    "pickletools", "platform", "plistlib", "poplib", "posixpath", "pprint", "queue", "quopri",
    "random", "re", "reprlib", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib",
    "socketserver", "statistics", "string", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "trace", "traceback", "types", "typing", "urllib.parse", "uuid",
    "wave", "weakref", "webbrowser", "xml.dom.minidom", "zipfile",
)


@dataclass(frozen=True)
class Example:
    text: str
    domain: str
    source: str  # spec_bench | gsm8k | stdlib | template | jsonl | traces
    group: str  # split unit: everything with one group is on one side

    def to_json(self) -> dict[str, str]:
        return {"text": self.text, "domain": self.domain, "source": self.source,
                "group": self.group}


def is_held_out(group: str, fraction: float) -> bool:
    """Deterministic group split: the same group lands on the same side everywhere."""
    return (zlib.crc32(group.encode()) % 1000) < fraction * 1000


def spec_bench(path: Path) -> Iterator[Example]:
    for line in path.read_text().splitlines():
        row = json.loads(line)
        domain = SPEC_BENCH_MAP[row["category"]]
        turns = [t for t in row["turns"] if t]
        for n in range(1, len(turns) + 1):
            yield Example("\n\n".join(turns[:n]), domain, "spec_bench",
                          f"spec_bench:{row['question_id']}")


def gsm8k(path: Path, limit: int) -> Iterator[Example]:
    with path.open() as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            yield Example(json.loads(line)["question"], "math", "gsm8k", f"gsm8k:{i}")


_WRITE = (
    "Write a Python function `{name}{sig}` that does the following: {doc}",
    "Implement {name}{sig} in Python. {doc}",
    "Can you write code for a function called {name}? It should: {doc}",
    "How would I implement `{name}` myself? Docstring: \"{doc}\"",
    "def {name}{sig}:\n    \"\"\"{doc}\"\"\"\n# complete this function",
)
_SNIPPET = (
    "What does this Python code do?\n\n```python\n{src}\n```",
    "Find the bug in the following function and fix it:\n{src}",
    "Write unit tests with pytest for this function:\n\n{src}",
    "Refactor this code to be more readable and add type hints:\n```\n{src}\n```",
    "Explain line by line:\n{src}",
    "Port this Python function to JavaScript:\n\n{src}",
)


def stdlib_code(modules: Iterable[str] = STDLIB_MODULES, seed: int = 0) -> Iterator[Example]:
    rng = random.Random(seed)
    for mod_name in modules:
        try:
            module = __import__(mod_name, fromlist=["_"])
        except ImportError:
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(obj):
                continue
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            yield from _code_examples(mod_name, name, obj, rng)


def _code_examples(mod_name: str, name: str, obj: object, rng: random.Random) -> Iterator[Example]:
    group = f"stdlib:{mod_name}"
    doc = inspect.getdoc(obj) or ""
    first = doc.split("\n\n")[0].replace("\n", " ").strip()
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        sig = "()"
    if first:
        tpl = rng.choice(_WRITE)
        yield Example(tpl.format(name=name, sig=sig, doc=first), "code", "stdlib", group)
    try:
        src = inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return
    lines = src.splitlines()[:30]
    if len(lines) >= 4:
        tpl = rng.choice(_SNIPPET)
        yield Example(tpl.format(src="\n".join(lines)), "code", "stdlib", group)
