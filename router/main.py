"""`ferry router`: build the app from the flags and serve it with uvicorn."""

from __future__ import annotations

import argparse
import logging


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from router.app import RouterApp
    from router.config import RouterConfig

    config = RouterConfig.from_args(args)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from router.pd_config import PDConfig

    app = RouterApp(config, pd=PDConfig.from_args(args))
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,
        lifespan="on",
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_keep_alive=60,
    )
    return 0
