"""tools/check_names.py: a name is free on a 404, taken on a project page, an error else.

A small HTTP server stands in for PyPI's JSON API, so the test needs no network."""

from __future__ import annotations

import http.server
import json
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import check_names  # noqa: E402


class _Index(http.server.BaseHTTPRequestHandler):
    taken = {"recurra-core": "1.0"}

    def do_GET(self):  # noqa: N802 (http.server's name)
        name = self.path.split("/")[2]
        if name == "broken":
            self.send_response(500)
            self.end_headers()
            return
        if name not in self.taken:
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps({"info": {"name": name, "version": self.taken[name], "summary": "x"}})
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def index():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Index)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_free_taken_and_errors(index):
    assert check_names.status(index, "recurra-models", 5)[0] == "free"
    state, detail = check_names.status(index, "recurra_core", 5)  # normalised to recurra-core
    assert state == "taken" and "1.0" in detail
    assert check_names.status(index, "broken", 5)[0] == "error"
    assert check_names.status("http://127.0.0.1:9", "recurra", 2)[0] == "error"


def test_exit_status_names_every_package(index, capsys):
    assert check_names.main(["--index", index]) == 1  # recurra-core is taken there
    out = capsys.readouterr().out
    for name in ("recurra", "recurra-core", "recurra-vulkan", "recurra-cli", "recurra-dist"):
        assert name in out
