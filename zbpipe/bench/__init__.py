"""zbpipe's microbenchmark harness: emulated devices (``emulated``) and, on top of them, the
``zbpipe bench`` command."""
