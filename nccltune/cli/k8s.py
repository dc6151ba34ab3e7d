"""`nccltune device-plugin`: the kubelet device plugin (k8s.deviceplugin) until SIGTERM."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from types import FrameType

from ..errors import EXIT_OK, InputError, UnavailableError
from .context import load_cfg


def cmd_device_plugin(args: argparse.Namespace) -> int:
    try:
        from ..k8s.deviceplugin import DevicePlugin
    except ImportError as exc:
        raise UnavailableError(f"the device plugin needs grpcio ({exc})",
                               hint="pip install 'nccltune[k8s]'") from None
    cfg = load_cfg(args)
    cdi_dir = Path(args.cdi_dir) if args.cdi_dir else cfg.cdi_dir
    if cdi_dir is None:
        raise InputError(args.config or "config", "publish.cdi_dir is not set: there is no CDI spec to hand out",
                         hint="set publish.cdi_dir (the DaemonSet's config sets /var/run/cdi) or pass --cdi-dir")
    plugin = DevicePlugin(cdi_dir, Path(args.plugin_dir), units=args.units, interval_s=args.interval,
                          annotations=args.cdi_annotations)

    def stop(_signum: int, _frame: FrameType | None) -> None:
        plugin.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    plugin.run()
    return EXIT_OK
