"""Running qwenrt as several replicas behind one endpoint (Ray Serve, `qwenrt serve --ray`). Only `ray_app` imports
Ray; `affinity` is the routing policy, plain Python."""
