"""``npm ci`` of one of the repository's Node.js examples, from its committed package-lock.json.

Install scripts are not run (none of the examples' dependencies needs one); a failure is an assertion
naming the folder, with npm's output.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def npm_ci(example_dir: Path) -> None:
    """Install ``example_dir``'s dependencies exactly as its lockfile names them."""
    npm = shutil.which("npm")
    assert npm is not None, "`node` is installed but `npm` is not: install npm to run the Node.js examples"
    result = subprocess.run(
        [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--prefer-offline"],
        cwd=example_dir,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, f"npm ci failed in {example_dir}:\n{result.stdout}\n{result.stderr}"
