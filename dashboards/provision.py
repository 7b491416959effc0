"""Provision the DSpark Grafana dashboard (``grafana/dspark.json``) into a Grafana, with ``grafana-client``.

    python -m dashboards.provision --url http://grafana:3000 --token $GRAFANA_TOKEN [--folder "DSpark"]

Creates or overwrites the dashboard (same ``uid``, ``overwrite: true``), in the named folder when ``--folder``
is given (created if no folder has that title), else in Grafana's General folder. The token is a Grafana
service-account token (Editor role, or Admin to create folders); ``--token`` defaults to ``$GRAFANA_TOKEN``.
The dashboard reads a Prometheus data source chosen by its ``datasource`` variable. Prints one JSON line with
the dashboard's uid, url, version and folder.

Does not own: the dashboard's content (edit ``grafana/dspark.json``) or the metrics (``app/serving/metrics.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaException

DASHBOARD = Path(__file__).resolve().parents[1] / "grafana" / "dspark.json"
TOKEN_ENV = "GRAFANA_TOKEN"


def load_dashboard(path: Path) -> dict:
    """The dashboard model from ``path``.

    Raises:
        ValueError: the file is not a JSON object with a non-empty ``uid``, ``title`` and ``panels``.
    """
    model = json.loads(path.read_text())
    if not isinstance(model, dict):
        raise ValueError(f"{path}: a dashboard is a JSON object, got {type(model).__name__}")
    for key in ("uid", "title", "panels"):
        if not model.get(key):
            raise ValueError(f"{path}: dashboard has no {key!r}")
    return model


def folder_uid(api: GrafanaApi, title: str) -> str:
    """Uid of the folder titled ``title``; created when none has that title."""
    for folder in api.folder.get_all_folders():
        if folder["title"] == title:
            return folder["uid"]
    return api.folder.create_folder(title)["uid"]


def provision(api: GrafanaApi, dashboard: dict, *, folder: str | None) -> dict:
    """Create or overwrite ``dashboard`` (matched by uid); returns Grafana's answer (uid, url, version...)."""
    payload = {"dashboard": {**dashboard, "id": None}, "overwrite": True,
               "message": "provisioned by dashboards.provision"}
    if folder:
        payload["folderUid"] = folder_uid(api, folder)
    return api.dashboard.update_dashboard(payload)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="Grafana base URL, e.g. http://127.0.0.1:3000")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                        help=f"Grafana service-account token (default: ${TOKEN_ENV})")
    parser.add_argument("--folder", default=None, help="folder title (created if missing); default: General")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD, help="dashboard JSON (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.token:
        parser.error(f"--token is required (or set ${TOKEN_ENV})")
    try:
        dashboard = load_dashboard(args.dashboard)
    except (OSError, ValueError) as err:
        parser.error(f"--dashboard: {err}")
    api = GrafanaApi.from_url(args.url, credential=args.token)
    try:
        result = provision(api, dashboard, folder=args.folder)
    except (OSError, GrafanaException) as err:  # niquests' connection errors are OSErrors
        print(f"error: could not provision the dashboard at {args.url}: {type(err).__name__}: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps({"uid": result.get("uid"), "url": result.get("url"), "version": result.get("version"),
                      "folder": args.folder}))


if __name__ == "__main__":
    main(sys.argv[1:])
