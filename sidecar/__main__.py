"""`python -m sidecar` is the `pubsub-sidecar` command."""

from sidecar.commands.main import main

raise SystemExit(main())
