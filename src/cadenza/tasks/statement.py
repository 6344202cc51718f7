"""Problem statements: what a developer would know, never the code or the tests' code."""

from __future__ import annotations

import textwrap

from cadenza.tasks.discover import Feature


def _describe_test(nodeid: str) -> str:
    name = nodeid.split("::")[-1].split("[")[0]
    words = name.removeprefix("test_").removeprefix("test").replace("_", " ").strip()
    return words or name


def problem_statement(
    feature: Feature,
    fail_to_pass: list[str],
    *,
    with_signature: bool = True,
    exported_from: list[str] = (),
) -> str:
    d = feature.defs[0]
    if feature.kind == "module":
        return _module_statement(feature, fail_to_pass, with_signature, exported_from)
    kind = "function" if d.kind == "function" else "class"
    parts = [
        f"The {kind} `{feature.name}` is missing from module `{feature.module}` "
        f"(file `{feature.file}`). Implement it so that the code that relies on it works again.",
    ]
    if with_signature:
        parts.append(f"Signature:\n\n    {d.signature}")
    if d.docstring:
        parts.append("Its documentation:\n\n" + textwrap.indent(d.docstring.strip(), "    "))
    if exported_from:
        parts.append(
            f"It is public API, exported from: {', '.join(f'`{m}`' for m in exported_from)}."
        )
    if feature.callers:
        shown = ", ".join(f"`{c}`" for c in feature.callers[:8])
        parts.append(f"Other code in the project uses it: {shown}.")
    parts.append(_hidden_tests(fail_to_pass))
    parts.append("You may add private helpers. Do not modify the tests or the test configuration.")
    return "\n\n".join(parts) + "\n"


def _module_statement(
    feature: Feature, fail_to_pass: list[str], with_signature: bool, exported_from: list[str]
) -> str:
    public = [d for d in feature.defs if not d.name.startswith("_")]
    parts = [
        f"The module `{feature.module}` (file `{feature.file}`) is missing. Write it so that "
        "the code that relies on it works again. Its public API:"
    ]
    for d in public:
        head = d.signature if with_signature else f"{d.kind} {d.name}"
        doc = (d.docstring or "").strip().splitlines()
        parts.append(f"- `{head}`" + (f": {doc[0]}" if doc else ""))
    if feature.callers:
        parts.append(f"Modules importing it: {', '.join(f'`{c}`' for c in feature.callers)}.")
    parts.append(_hidden_tests(fail_to_pass))
    parts.append("You may add private helpers. Do not modify the tests or the test configuration.")
    return "\n\n".join(parts) + "\n"


def _hidden_tests(fail_to_pass: list[str]) -> str:
    behaviours = sorted({_describe_test(t) for t in fail_to_pass})
    files = sorted({t.split("::")[0] for t in fail_to_pass})
    return (
        f"Hidden tests ({len(fail_to_pass)}, in {', '.join(files)}) check these behaviours:\n"
        + "\n".join(f"- {b}" for b in behaviours[:25])
        + (f"\n- ... and {len(behaviours) - 25} more" if len(behaviours) > 25 else "")
    )
