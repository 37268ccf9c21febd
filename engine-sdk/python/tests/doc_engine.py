"""Prints the minimal engine of docs/engines-in-python.md (its one ```python
block), so test.sh can type-check it and tests/engines/sdk_python.rs can run
it against the conformance kit."""

import os
import re

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "docs", "engines-in-python.md")


def code() -> str:
    with open(DOC) as f:
        found = re.search(r"```python\n(.*?)```", f.read(), re.S)
    assert found is not None, f"{DOC} has no python block"
    return found.group(1)


if __name__ == "__main__":
    print(code(), end="")
