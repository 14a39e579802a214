"""Writes the Python standard library's docstrings as JSONL: a small real-text corpus for
trying `data.source='files:DIR/*.jsonl'` (docs/data.md, "Training on your own text").

    python docs/docstrings_jsonl.py /tmp/docstrings   # -> a-m.jsonl, n-z.jsonl
"""

import ast
import json
import os
import pathlib
import sys
import sysconfig


def main(out: str) -> None:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  rows: dict[str, list[dict]] = {}
  for path in sorted(root.rglob("*.py")):
    if "site-packages" in path.parts or "test" in path.parts:
      continue
    try:
      tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
      continue
    for node in ast.walk(tree):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc and len(doc) > 80:
          part = "a-m" if path.name[0].lower() <= "m" else "n-z"
          rows.setdefault(part, []).append({"text": doc, "where": str(path.relative_to(root))})
  os.makedirs(out, exist_ok=True)
  for part, docs in rows.items():
    with open(os.path.join(out, f"{part}.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in docs)
    print(f"{out}/{part}.jsonl: {len(docs)} docstrings")


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/docstrings")
