"""What the tests share: models (model_registry), schedules (schedule_registry), the one
tolerance (asserts), in-process loopback worlds (loopback), the NCCL model (nccl_model), the
independent program checker (program_checker), torch's schedule machinery (pytorch_peer) and
the environment of tests that start zbpipe in a child process (subprocess_env)."""
