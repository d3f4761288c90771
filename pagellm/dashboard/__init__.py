"""The KV cache dashboard: a static page and a script that draw KV views (core/kv_view.py).

``pagellm serve`` serves the page at ``/dashboard`` (the script polls ``/stats/blocks``);
``render_report`` writes the same views into one self-contained HTML file, with no server
(``pagellm bench memory --html``). Plain HTML, CSS and JavaScript, shipped as package data.
"""
from __future__ import annotations

import html
import json
from importlib import resources
from typing import Any

ASSETS = ("dashboard.html", "dashboard.js", "dashboard.css")


def asset(name: str) -> str:
    """The text of one of the dashboard's files."""
    if name not in ASSETS:
        raise ValueError(f"unknown dashboard file {name!r}: one of {', '.join(ASSETS)}")
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def render_report(systems: list[dict[str, Any]], title: str = "pagellm KV cache report",
                  intro: str = "") -> str:
    """A static page with each system's block maps and charts.

    ``systems``: ``{"name", "title", "description", "frames": [KV view, ...], "history":
    [history point, ...], "default_frame": int}``; a slider moves between the frames.
    """
    if not systems:
        raise ValueError("a report needs at least one system, got none")
    # A JSON script block: "</" is escaped so that no string in it can close the element.
    data = json.dumps(systems, separators=(",", ":")).replace("</", "<\\/")
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>
{asset("dashboard.css")}
</style>
</head>
<body>
<header><h1>{html.escape(title)}</h1></header>
<p>{html.escape(intro)}</p>
<main id="app"></main>
<script type="application/json" id="report-data">{data}</script>
<script>
{asset("dashboard.js")}
PagellmDashboard.report(document.getElementById("app"),
                        JSON.parse(document.getElementById("report-data").textContent));
</script>
</body>
</html>
"""
