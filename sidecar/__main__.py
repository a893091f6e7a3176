"""`python -m sidecar` is the `pubsub-sidecar` command."""

from sidecar.cli import main

raise SystemExit(main())
