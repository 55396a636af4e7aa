"""What the gRPC servers of wuliang share (serving's and the parameter
server's): TLS (``tls``), listening errors (``net``), the shared token
(``auth``) and message classes built from a ``.proto`` descriptor
(``messages``). Modules import grpcio or protobuf only where they need
them, so importing ``wuliang.ps_server`` never does."""
