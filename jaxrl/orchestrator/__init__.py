"""jaxrl.orchestrator"""
