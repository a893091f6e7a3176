"""Google access checked before a command makes its first Google client: one line naming what to set.

Rules:

- A command names the Google services it talks to (``PUBSUB``, ``FIRESTORE``, ``MONITORING``) and
  calls ``require_google_access`` before it builds a client. A service whose emulator variable is
  set (``PUBSUB_EMULATOR_HOST``, ...) needs no credentials: the clients then talk to the emulator
  without any. The check reads the environment only, so it costs nothing against the emulators.
- Otherwise Application Default Credentials must be found, in google.auth's own order:
  ``GOOGLE_APPLICATION_CREDENTIALS`` (a file that exists), gcloud's ADC file, the metadata server
  (GKE, Compute Engine). The search is ``google.auth.default()`` itself, in a daemon thread bounded by
  ``SEARCH_DEADLINE_SECONDS``: where nothing answers at the metadata address, google.auth pings it 3
  times with a 3 s timeout each and backs off in between (over 10 s); the bound turns that into the
  same one line. Its WARNING logs about the unavailable metadata server are kept out of the output.
  Where a metadata server is only slow to start (a new GKE node), the command exits 2 and the
  container's restart searches again.
- Whatever is missing becomes ``GoogleAccessMissing``, whose ``str()`` is one line: what is missing,
  the emulator variables to export (as `pubsub-sidecar emulators` prints them) or the credential to
  set. ``sidecar.commands.main`` prints it as ``pubsub-sidecar <command>: <line>`` and exits 2, like a config
  error. Commands that only talk to a running sidecar (``status``, ``unblock``) and those that start
  their own emulators (``emulators``, ``demo``, ``bench``) never call it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping

PUBSUB = "PUBSUB_EMULATOR_HOST"
FIRESTORE = "FIRESTORE_EMULATOR_HOST"
MONITORING = "MONITORING_EMULATOR_HOST"
"""The emulator variable of each service: the names a command passes to ``require_google_access``."""

CREDENTIALS_FILE_ENV = "GOOGLE_APPLICATION_CREDENTIALS"

SEARCH_DEADLINE_SECONDS = 5.0
"""How long the credential search may take in all. Where a metadata server answers (GKE, GCE) it
takes milliseconds; where a firewall drops packets to its address, google.auth alone takes over 10 s."""

_QUIET_LOGGERS = ("google.auth._default", "google.auth.compute_engine._metadata", "google.auth.transport")
"""google.auth's loggers that warn about the missing metadata server while searching."""


class GoogleAccessMissing(Exception):
    """No way to reach a Google service: neither its emulator variable nor credentials. One line."""


def require_google_access(services: Iterable[str], env: Mapping[str, str] | None = None) -> None:
    """Raise ``GoogleAccessMissing`` unless every service in ``services`` (emulator variable names)
    has its emulator variable set or Application Default Credentials can be found.

    ``env`` (default ``os.environ``) is where the emulator variables and ``GOOGLE_APPLICATION_CREDENTIALS``
    are read; the search itself is google.auth's, over ``os.environ``."""
    environ = os.environ if env is None else env
    unset = [name for name in dict.fromkeys(services) if not environ.get(name, "").strip()]
    if not unset:
        return
    problem = _credentials_problem(environ)
    if problem is None:
        return
    raise GoogleAccessMissing(
        f"{problem}, and {_names(unset)} {'is' if len(unset) == 1 else 'are'} not set: "
        "against the emulators, export what `pubsub-sidecar emulators` prints; "
        f"against Google Cloud, set {CREDENTIALS_FILE_ENV} to a service account key file or run "
        "`gcloud auth application-default login` (on GKE: Workload Identity)"
    )


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _credentials_problem(environ: Mapping[str, str]) -> str | None:
    """Why Application Default Credentials cannot be had (one clause), or None when they can."""
    named = environ.get(CREDENTIALS_FILE_ENV) or None  # empty is unset, as google.auth reads it
    if named is not None and not os.path.isfile(named):
        return f"{CREDENTIALS_FILE_ENV} names {named!r}, which is not a file"
    from google.auth.exceptions import DefaultCredentialsError

    outcome: list[BaseException | None] = []

    def search() -> None:
        import google.auth

        try:
            google.auth.default()
        except Exception as exc:  # DefaultCredentialsError, or a malformed file's ValueError & co.
            outcome.append(exc)
        else:
            outcome.append(None)

    quiet = _DropRecords()
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    thread = threading.Thread(target=search, name="credentials-search", daemon=True)
    thread.start()
    thread.join(SEARCH_DEADLINE_SECONDS)
    if not thread.is_alive():  # one still searching keeps them quiet: the command ends now anyway
        for logger in loggers:
            logger.removeFilter(quiet)
    if not outcome:
        return (
            f"no Google credentials found within {SEARCH_DEADLINE_SECONDS:g} s ({CREDENTIALS_FILE_ENV} unset, "
            "no gcloud ADC file, and the metadata server did not answer)"
        )
    error = outcome[0]
    if error is None:
        return None
    if isinstance(error, DefaultCredentialsError) and named is None:
        return f"no Google credentials found ({CREDENTIALS_FILE_ENV} unset, no gcloud ADC file, no metadata server)"
    return f"the Google credentials cannot be used ({' '.join(str(error).split())})"


class _DropRecords(logging.Filter):
    """Drops every record of the loggers it is added to, while the search runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False
