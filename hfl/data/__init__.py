"""Data layer: datasets, partitions among devices, and the federation the algorithms run on."""

from hfl.data.federation import DATASETS, PARTITIONS, DeviceData, Federation, build_federation, proxy_data

__all__ = ["DATASETS", "PARTITIONS", "DeviceData", "Federation", "build_federation", "proxy_data"]
