"""Lightning Fabric's :class:`AMPPrecision`: ``Fabric(plugins=[AMPPrecision("16-mixed")])``.

Importing this module imports Lightning (``import amp_plugin`` does not); the plugin lives in
:mod:`amp_plugin.lightning.fabric`. The Trainer's plugin of the same name is
``amp_plugin.AMPPrecision``, as Lightning names its ``MixedPrecision`` in both packages.
"""

from __future__ import annotations

from amp_plugin.lightning.fabric import AMPPrecision

__all__ = ["AMPPrecision"]
