"""The exit codes of the ``pubsub-sidecar`` commands: one name per meaning, shared by every command.

- ``EXIT_OK`` (0): the command did its job.
- ``EXIT_FAILED`` (1): the command failed: the sidecar or a backend refused or could not be
  reached, or a component of the running sidecar failed for good (Kubernetes restarts it).
- ``EXIT_USAGE`` (2): the user must fix the command line, the config file or the environment
  (argparse exits 2 on a bad command line, and a config error is 2 as well: ``sidecar.config.model``).

``status`` answers 1 for any failure, an empty ``--target`` included (its documented contract).
A command prints one line on stderr before it exits non-zero.
"""

from __future__ import annotations

EXIT_OK = 0
"""The command did its job."""

EXIT_FAILED = 1
"""The command failed: a refusal, no answer, or a component of the sidecar that failed for good."""

EXIT_USAGE = 2
"""A command line, config file or environment the user must fix (argparse's code for a bad command line)."""
