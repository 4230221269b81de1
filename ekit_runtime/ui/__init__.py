"""``ekit ui``: a local web dashboard of a run queue or of one store file (docs/dashboard.md).

Stdlib only (``http.server``), everything served by the package. Build a
server with :func:`make_server` over a :class:`QueueSource` or a
:class:`FileSource`, then ``serve_forever()``; the command line is
:func:`ekit_runtime.cli.ui.add_parser`.
"""

from __future__ import annotations

from ekit_runtime.ui.server import Dashboard, make_server, serve
from ekit_runtime.ui.sources import FileSource, QueueSource, RunView, Source

__all__ = ["Dashboard", "FileSource", "QueueSource", "RunView", "Source", "make_server", "serve"]
