"""The embedded dashboard's records of a closed browser tab are dropped; its other errors are not.
(Dask's logging config gives tornado's and Bokeh's loggers handlers of their own, so the records
are watched there, not at the root.)"""

from __future__ import annotations

import logging

from tornado.iostream import StreamClosedError
from tornado.websocket import WebSocketClosedError

from flows.cluster import _quiet_dashboard


class _Seen(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _log_raised(logger: logging.Logger, exc: BaseException, message: str) -> None:
    try:
        raise exc
    except BaseException:
        logger.error(message, exc_info=True)


def test_a_closed_tab_logs_nothing_and_other_errors_still_show():
    _quiet_dashboard()
    _quiet_dashboard()  # twice: one filter, not two
    app, ws = logging.getLogger("tornado.application"), logging.getLogger("bokeh.server.views.ws")
    assert len(app.filters) == 1 and len(ws.filters) == 1
    seen = _Seen()
    for logger in (app, ws):
        logger.addHandler(seen)
    try:
        _log_raised(app, WebSocketClosedError(), "Uncaught exception GET /status/ws (127.0.0.1)")
        try:
            raise StreamClosedError()
        except StreamClosedError as closed:
            try:
                raise RuntimeError("write failed") from closed
            except RuntimeError as wrapped:
                _log_raised(app, wrapped, "Exception in callback")
        ws.error("Failed sending message as connection was closed")
        assert seen.messages == []
        _log_raised(app, KeyError("start"), "Exception in callback update")
        ws.error("Refusing websocket connection from Origin 'http://evil'")
        assert seen.messages == ["Exception in callback update", "Refusing websocket connection from Origin 'http://evil'"]
    finally:
        for logger in (app, ws):
            logger.removeHandler(seen)
