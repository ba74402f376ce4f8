//! Ownership of the KV cache's blocks: a free list and a reference count per block
//! (a block is shared by every sequence whose prefix it holds, and by the prefix cache).

/// Hands out block ids and takes them back when the last holder lets go.
#[derive(Debug)]
pub struct BlockPool {
    refs: Vec<u32>,
    free: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            refs: vec![0; num_blocks],
            // Popped from the end: low ids first.
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// A fresh block with one reference, or `None` when the pool is exhausted.
    pub fn alloc(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.refs[b as usize] = 1;
        Some(b)
    }

    pub fn incref(&mut self, b: u32) {
        debug_assert!(self.refs[b as usize] > 0, "incref of a free block {b}");
        self.refs[b as usize] += 1;
    }

    /// Drops one reference; returns whether the block went back to the free list.
    pub fn decref(&mut self, b: u32) -> bool {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0, "decref of a free block {b}");
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
            true
        } else {
            false
        }
    }

    pub fn refcount(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }
}

/// The KV cache's block for pool block `block`: pool block b is cache block b + 1 (cache
/// block 0 is the scratch block that padding rows of decode graphs write to).
pub(super) fn cache_block(block: u32) -> i64 {
    block as i64 + 1
}

/// The KV-cache slot of position `pos` of a sequence holding pool `blocks`.
pub(super) fn cache_slot(blocks: &[u32], pos: usize, block_size: usize) -> i64 {
    cache_block(blocks[pos / block_size]) * block_size as i64 + (pos % block_size) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_return_when_the_last_reference_goes() {
        let mut pool = BlockPool::new(2);
        let a = pool.alloc().unwrap();
        let b = pool.alloc().unwrap();
        assert_ne!(a, b);
        assert!(pool.alloc().is_none());
        pool.incref(a);
        assert!(!pool.decref(a));
        assert_eq!(pool.num_free(), 0);
        assert!(pool.decref(a));
        assert_eq!(pool.alloc(), Some(a));
    }
}
