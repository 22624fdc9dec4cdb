"""Single writer of the slot maps, checked on the source (docs/PREFETCH.md "Single writer"): outside the slot
cache's own package no code writes `slot_for_id`, `id_of_slot`, `usage`, `expert_recency`, `expert_count` or the
victim list; the calls that write them (`ensure`, `prefetch_ensure`, `reset`, `set_policy` of kernels.slot_cache)
never sit inside a `with torch.cuda.stream(...)` block, so they run on the compute stream in program order; and the
predictor's block reads no cache state. Each rule is also run on a snippet that breaks it (the checker can fail)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "ftexpert"
SCANNED = ("gpu_worker/backends", "gpu_worker/engine", "gpu_worker/models", "gpu_worker/assembly")
MAP_NAMES = {"slot_for_id", "id_of_slot", "usage", "expert_recency", "expert_count", "victim_keys", "victim_owner",
             "step"}
WRITING_METHODS = {"copy_", "fill_", "zero_", "index_put_", "scatter_", "index_copy_", "add_", "masked_fill_"}
MAP_WRITERS = {"ensure", "prefetch_ensure", "reset", "set_policy"}


def _is_map_attr(node: ast.AST) -> bool:
    """`x.slot_for_id` (or x.slot_for_id[...]) for a map name, on an object that is a cache (named *cache or c)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if not isinstance(node, ast.Attribute) or node.attr not in MAP_NAMES:
        return False
    owner = node.value
    name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
    return name in ("c", "cache") or name.endswith("cache")


def _is_stream_block(item: ast.withitem) -> bool:
    call = item.context_expr
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "stream"
            and "cuda" in ast.unparse(call.func.value))


def problems(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    out: list[str] = []

    def visit(node: ast.AST, in_stream: bool) -> None:
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if _is_map_attr(target):
                    out.append(f"{where}:{node.lineno}: writes a slot map ({ast.unparse(target)})")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in WRITING_METHODS and _is_map_attr(node.func.value):
                out.append(f"{where}:{node.lineno}: writes a slot map ({ast.unparse(node.func)})")
        if isinstance(node, ast.Call) and in_stream:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in MAP_WRITERS and "cache" in ast.unparse(node) or name in ("ensure", "prefetch_ensure"):
                out.append(f"{where}:{node.lineno}: {name}(...) inside a side-stream block")
        if isinstance(node, ast.With) and any(_is_stream_block(i) for i in node.items):
            text = ast.unparse(node)
            if "predict_stream" in ast.unparse(node.items[0].context_expr) and "cache" in text:
                out.append(f"{where}:{node.lineno}: the predictor's stream block reads cache state")
            for child in node.body:
                visit(child, True)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, in_stream)

    visit(tree, False)
    return out


def test_no_slot_map_writes_outside_the_compute_stream_and_the_slot_cache():
    found = []
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 20, "the scan found the backends' sources"
    for path in files:
        found += problems(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "slot-map writers off the compute stream:\n" + "\n".join(found)


def test_the_checker_catches_each_violation():
    bad_write = "def f(self):\n    self.cache.usage[3] = 0\n"
    bad_copy = "def f(c):\n    c.slot_for_id.fill_(-1)\n"
    bad_stream = ("def f(self):\n    with torch.cuda.stream(self.copy_stream):\n"
                  "        prefetch_ensure(self.cache, 1, cand, 2)\n")
    bad_predictor = ("def f(self):\n    with torch.cuda.stream(self.predict_stream):\n"
                     "        x = self.cache.slot_for_id[0]\n")
    fine = ("def f(self):\n    ensure(self.cache, 0, ids)\n    with torch.cuda.stream(self.copy_stream):\n"
            "        copy_plan(self.slots, host, c.prefetch_evict_slots, c.prefetch_src_indices, n)\n")
    for src in (bad_write, bad_copy, bad_stream, bad_predictor):
        assert problems(src, "snippet"), f"not caught:\n{src}"
    assert problems(fine, "snippet") == []
