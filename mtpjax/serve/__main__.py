"""`python -m mtpjax.serve MODEL [--host H] [--port P] [options]` (also `mtpjax serve`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Parses argv (default sys.argv[1:]; without the subcommand name), loads the model, serves
    until interrupted; returns the exit status (0)."""
    from mtpjax.serve.server import Server, build_parser
    try:
        import uvicorn
    except ImportError:
        raise SystemExit("mtpjax serve needs fastapi and uvicorn: pip install 'mtpjax[serve]'") \
            from None
    args = build_parser().parse_args(argv)
    server = Server.from_args(args)
    app = server.app()
    print(f"mtpjax serve: {server.ctx.model_name} on http://{args.host}:{args.port} "
          f"(MTP: K={server.ctx.num_speculative_tokens}"
          f"{', ' + server.ctx.acceptance if server.ctx.acceptance else ''}; chat template: "
          f"{getattr(server.ctx.chat_template, 'origin', 'none')})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        server.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
