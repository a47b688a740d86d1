"""jaxrl.trainer"""
