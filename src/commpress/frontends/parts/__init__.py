"""Pieces the front-ends share: buckets, the clip guard, replica checks, and DiLoCo's
fragments and sites."""
