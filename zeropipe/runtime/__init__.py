"""The pipeline runtime: stages, action handlers, transports, executors."""
