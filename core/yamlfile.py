"""YAML as a person means it: one value per key.

PyYAML keeps the last value of a key given twice, so a recipe with ``name:`` twice, or a second ``teacher:``
section further down, silently replaces the first.  :func:`load_yaml` refuses a repeated key at any depth and
names its path and both line numbers.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Tuple

import yaml

from vfm_toolchain.core.errors import ToolchainError

__all__ = ["load_yaml", "repeated_keys"]


def repeated_keys(text: str) -> List[Tuple[str, List[int]]]:
    """(dotted path, line numbers) of every key given more than once in one mapping of ``text``."""
    found: List[Tuple[str, List[int]]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            lines: Dict[Any, List[int]] = defaultdict(list)
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                if name is not None and key.tag != "tag:yaml.org,2002:merge":
                    lines[name].append(key.start_mark.line + 1)
                walk(value, f"{path}.{name}" if path else str(name))
            found.extend((f"{path}.{k}" if path else str(k), n) for k, n in lines.items() if len(n) > 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{path}[{i}]")

    walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    return sorted(found, key=lambda kv: kv[1][0])


def load_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load(text)``, refusing a key given twice in one mapping (``source`` names the text in the
    message: "recipe 'x.yaml'", "--set teacher=...").

    Raises:
        yaml.YAMLError: the text is not YAML (the caller words it).
        ToolchainError: a repeated key, with its path and line numbers.
    """
    twice = repeated_keys(text)
    if twice:
        shown = "; ".join(f"'{path}' on lines {', '.join(map(str, lines[:-1]))} and {lines[-1]}"
                          for path, lines in twice[:5])
        more = f"; and {len(twice) - 5} more" if len(twice) > 5 else ""
        raise ToolchainError(f"{source} gives a key more than once: {shown}{more}. YAML would keep only the last "
                             f"value without a word; give each key once (merge the two sections or remove one)")
    return yaml.safe_load(text)
