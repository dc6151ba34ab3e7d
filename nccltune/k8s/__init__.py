"""Kubernetes: the kubelet device plugin that hands out nccltune's CDI devices (deviceplugin.py,
its messages in wire.py). Needs the `k8s` extra (grpcio); nothing else of nccltune imports it."""
