"""The entry point of one RPC session on a PIT server (:func:`pit_tvm.tuning.rpc_server.init_server_process`
installs it): a fresh process that registers the functions the PIT runner calls by name, then
serves the session as TVM's own server loop does."""


def serve_session(sock, load_library, work_path) -> None:
    """``tvm.rpc.server._serve_loop`` with :func:`pit_tvm.tuning._worker.register_server_functions` first"""
    from tvm.rpc import server

    from pit_tvm.tuning._worker import register_server_functions

    register_server_functions()
    server._serve_loop(sock, load_library, work_path)
