"""Collective times on the links a group crosses (perf/links.py)."""

import dataclasses

from shardax.perf import hardware, links


def test_an_all_to_all_over_a_2d_group_travels_the_sum_of_its_dims_hops():
  """64 chips as an 8x8 torus plane: a byte travels 8/4 + 8/4 = 4 hops on average, against
  64/4 = 16 around a ring of 64; the plane also has twice the links. It was priced as if
  the 64 sat on one ring (g/4 hops over the plane's links): 4x too slow, and moe.gshard_1t's
  2048 cores on v3's 32x32 torus 32x too slow (512 hops for 16)."""
  v4 = hardware.lookup("TPU v4")
  plane = links.Route(64, 64, 1, dims=((8, True), (8, True)))
  ring = links.Route(64, 64, 1, dims=((64, True),))
  b = 64 * 2**20
  t_plane = links.seconds("all-to-all", b, plane, v4) - links.ICI_LATENCY
  t_ring = links.seconds("all-to-all", b, ring, v4) - links.ICI_LATENCY
  assert abs(t_ring / t_plane - 8.0) < 1e-6      # 4x fewer hops, 2x the links
  bw = links.ici_bandwidth(v4, plane)
  assert abs(t_plane - b * 63 / 64 / bw * 4) < 1e-9
