"""jaxrl.inference"""
