"""The README's commands as the tests read them: the lines of its ```bash blocks."""

from __future__ import annotations


def bash_lines(text: str) -> list[str]:
    """The lines of every ```bash block, comments and blank lines dropped."""
    lines, inside = [], False
    for line in text.splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            inside = not inside and fence == "```bash"
            continue
        if inside:
            command = line.split(" #", 1)[0].strip()  # a trailing comment
            if command and not command.startswith("#"):
                lines.append(command)
    return lines
