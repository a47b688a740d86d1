"""jaxrl.parallel"""
