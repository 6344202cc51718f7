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
    behaviours = sorted({_describe_test(t) for t in fail_to_pass})
    files = sorted({t.split("::")[0] for t in fail_to_pass})
    parts.append(
        f"Hidden tests ({len(fail_to_pass)}, in {', '.join(files)}) check these behaviours:\n"
        + "\n".join(f"- {b}" for b in behaviours[:25])
        + (f"\n- ... and {len(behaviours) - 25} more" if len(behaviours) > 25 else "")
    )
    parts.append("You may add private helpers. Do not modify the tests or the test configuration.")
    return "\n\n".join(parts) + "\n"
