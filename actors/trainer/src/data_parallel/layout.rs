//! How the flattened parameter list is cut for ZeRO-2 (Megatron's distributed optimizer):
//! consecutive parameters fill buckets of about `bucket_numel` elements; each bucket is
//! padded to `world × shard` elements and rank r owns its slice `[r × shard, (r + 1) ×
//! shard)`. A rank's optimizer state is the concatenation of its slices of every bucket,
//! one contiguous buffer; with one bucket it is simply the r-th contiguous shard of the
//! flattened list. Buckets are the unit of the gradient reduce-scatter and of the
//! parameter all-gather.

use std::ops::Range;

/// Shards are rounded up to this many elements, so every slice starts aligned (128
/// bytes of bf16) for the collectives and the fused optimizer kernel.
pub const SHARD_ALIGN: usize = 64;

/// One parameter's place in its bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSlot {
    pub name: String,
    pub shape: Vec<i64>,
    pub numel: usize,
    pub bucket: usize,
    /// Start within the bucket's flat buffer.
    pub offset: usize,
}

/// A run of consecutive parameters reduced and gathered together.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    /// Indices into [`FlatLayout::params`].
    pub params: Range<usize>,
    /// Elements of real parameters.
    pub numel: usize,
    /// Elements each rank owns: `world × shard ≥ numel`.
    pub shard: usize,
    /// Where this bucket's slice starts in a rank's shard buffer.
    pub shard_offset: usize,
}

impl Bucket {
    /// The bucket's flat length, padding included.
    pub fn padded(&self, world: usize) -> usize {
        self.shard * world
    }
}

/// The parameters in order, their buckets and the ranks' shards.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatLayout {
    pub world: usize,
    pub params: Vec<ParamSlot>,
    pub buckets: Vec<Bucket>,
    /// Elements of one rank's shard buffer (sum of the buckets' shards).
    pub shard_numel: usize,
}

impl FlatLayout {
    /// Lays out `params` (name, shape), in order, for `world` ranks in buckets of about
    /// `bucket_numel` elements (a larger parameter gets a bucket of its own).
    pub fn new(params: &[(String, Vec<i64>)], world: usize, bucket_numel: usize) -> Self {
        let world = world.max(1);
        let mut slots = Vec::with_capacity(params.len());
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut start = 0;
        let mut filled = 0;
        let close = |buckets: &mut Vec<Bucket>, range: Range<usize>, numel: usize| {
            let shard = numel.div_ceil(world).div_ceil(SHARD_ALIGN) * SHARD_ALIGN;
            let shard_offset = buckets.last().map_or(0, |b| b.shard_offset + b.shard);
            buckets.push(Bucket {
                params: range,
                numel,
                shard,
                shard_offset,
            });
        };
        for (i, (name, shape)) in params.iter().enumerate() {
            let numel = shape.iter().product::<i64>().max(0) as usize;
            if i > start && filled + numel > bucket_numel {
                close(&mut buckets, start..i, filled);
                start = i;
                filled = 0;
            }
            slots.push(ParamSlot {
                name: name.clone(),
                shape: shape.clone(),
                numel,
                bucket: buckets.len(),
                offset: filled,
            });
            filled += numel;
        }
        if start < params.len() {
            close(&mut buckets, start..params.len(), filled);
        }
        let shard_numel = buckets.last().map_or(0, |b| b.shard_offset + b.shard);
        Self {
            world,
            params: slots,
            buckets,
            shard_numel,
        }
    }

    /// One bucket per group of `groups`, in order (ZeRO-3: a group is what is gathered
    /// and reduced together, one decoder layer or the embedding, final norm and head),
    /// each padded and split evenly over `world` ranks as [`FlatLayout::new`]'s buckets.
    pub fn grouped(groups: &[Vec<(String, Vec<i64>)>], world: usize) -> Self {
        let world = world.max(1);
        let mut slots = Vec::new();
        let mut buckets: Vec<Bucket> = Vec::with_capacity(groups.len());
        for group in groups {
            let first = slots.len();
            let mut filled = 0;
            for (name, shape) in group {
                let numel = shape.iter().product::<i64>().max(0) as usize;
                slots.push(ParamSlot {
                    name: name.clone(),
                    shape: shape.clone(),
                    numel,
                    bucket: buckets.len(),
                    offset: filled,
                });
                filled += numel;
            }
            let shard = filled.div_ceil(world).div_ceil(SHARD_ALIGN) * SHARD_ALIGN;
            let shard_offset = buckets.last().map_or(0, |b| b.shard_offset + b.shard);
            buckets.push(Bucket {
                params: first..slots.len(),
                numel: filled,
                shard,
                shard_offset,
            });
        }
        let shard_numel = buckets.last().map_or(0, |b| b.shard_offset + b.shard);
        Self {
            world,
            params: slots,
            buckets,
            shard_numel,
        }
    }

    /// The elements of the flattened parameter list (no padding) rank `rank` owns, as
    /// (bucket, range within the bucket's padded buffer, clipped to real elements).
    pub fn owned(&self, rank: usize) -> Vec<(usize, Range<usize>)> {
        self.buckets
            .iter()
            .enumerate()
            .map(|(b, bucket)| {
                let start = (rank * bucket.shard).min(bucket.numel);
                let end = ((rank + 1) * bucket.shard).min(bucket.numel);
                (b, start..end)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(name: &str, shape: &[i64]) -> (String, Vec<i64>) {
        (name.to_string(), shape.to_vec())
    }

    #[test]
    fn buckets_cover_every_element_once_and_shards_tile_them() {
        let params = [p("a", &[3, 5]), p("b", &[7]), p("c", &[100]), p("d", &[1])];
        let l = FlatLayout::new(&params, 3, 20);
        // a + b = 22 > 20: a alone; b; c is larger than a bucket: alone; then d.
        let ranges: Vec<_> = l.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(ranges, vec![0..1, 1..2, 2..3, 3..4]);
        for b in &l.buckets {
            assert!(b.padded(3) >= b.numel && b.shard % SHARD_ALIGN == 0);
        }
        let total: usize = (0..3).flat_map(|r| l.owned(r)).map(|(_, r)| r.len()).sum();
        assert_eq!(total, 15 + 7 + 100 + 1);
        let one = FlatLayout::new(&params, 2, usize::MAX);
        assert_eq!(one.buckets.len(), 1);
        assert_eq!(one.params[2].offset, 22);
        assert_eq!(one.shard_numel, one.buckets[0].shard);
    }

    #[test]
    fn grouped_layouts_make_one_bucket_per_group() {
        let groups = vec![
            vec![p("embed", &[10, 4]), p("norm", &[4])],
            vec![p("layer0.a", &[4, 4]), p("layer0.b", &[3])],
        ];
        let l = FlatLayout::grouped(&groups, 2);
        let ranges: Vec<_> = l.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(ranges, vec![0..2, 2..4]);
        assert_eq!((l.buckets[0].numel, l.buckets[1].numel), (44, 19));
        assert_eq!(l.params[3].offset, 16);
        assert_eq!(l.params[3].bucket, 1);
        assert_eq!(l.buckets[1].shard_offset, l.buckets[0].shard);
        assert_eq!(l.shard_numel, 2 * SHARD_ALIGN);
    }
}
