import sys

try:
    from coordinator.cli import main
except KeyboardInterrupt:   # Ctrl-C while the daemon was still starting: no traceback
    print("rtxnet-coordinator: interrupted while starting", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
