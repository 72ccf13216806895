//! A seeded shuffle of the kept records with bounded memory: each record
//! goes to one of [`BUCKETS`] files on disk by a seeded hash of its index;
//! at the end each bucket is read back, shuffled in memory with a seeded
//! generator, and handed on, bucket after bucket. With independent, uniform
//! bucket choices this gives every order the same chance, while memory
//! holds one bucket (about 1/64 of the kept records) at a time. The same
//! input and seed give the same order.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::seq::SliceRandom;

use super::{DatasetError, unit_hash};

/// Buckets the kept records are spread over.
const BUCKETS: usize = 64;

pub struct Shuffler {
    dir: PathBuf,
    seed: u64,
    buckets: Vec<BufWriter<File>>,
    pushed: u64,
}

impl Shuffler {
    /// Bucket files go in `<output_dir>/.shuffle/` (removed at the end).
    pub fn new(output_dir: &Path, seed: u64) -> Result<Shuffler, DatasetError> {
        let dir = output_dir.join(".shuffle");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| DatasetError::io(&dir, e))?;
        let mut buckets = Vec::with_capacity(BUCKETS);
        for i in 0..BUCKETS {
            let p = dir.join(format!("{i}.jsonl"));
            let f = File::create(&p).map_err(|e| DatasetError::io(&p, e))?;
            buckets.push(BufWriter::new(f));
        }
        Ok(Shuffler {
            dir,
            seed,
            buckets,
            pushed: 0,
        })
    }

    pub fn push(&mut self, record: &str) -> Result<(), DatasetError> {
        // A different stream of the seed than the split's draw.
        let u = unit_hash(self.seed ^ 0x5851_F42D_4C95_7F2D, self.pushed);
        let i = ((u * BUCKETS as f64) as usize).min(BUCKETS - 1);
        self.pushed += 1;
        let w = &mut self.buckets[i];
        w.write_all(record.as_bytes())
            .and_then(|()| w.write_all(b"\n"))
            .map_err(|e| DatasetError::io(&self.dir, e))
    }

    /// Hands every record on in shuffled order, then removes the buckets.
    pub fn drain(
        self,
        mut each: impl FnMut(&str) -> Result<(), DatasetError>,
    ) -> Result<(), DatasetError> {
        let io = |e| DatasetError::io(&self.dir, e);
        for (i, w) in self.buckets.into_iter().enumerate() {
            w.into_inner().map_err(|e| io(e.into_error()))?;
            let p = self.dir.join(format!("{i}.jsonl"));
            let mut lines: Vec<String> = BufReader::new(File::open(&p).map_err(io)?)
                .lines()
                .collect::<Result<_, _>>()
                .map_err(io)?;
            let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed.wrapping_add(i as u64));
            lines.shuffle(&mut rng);
            for line in &lines {
                each(line)?;
            }
            let _ = std::fs::remove_file(&p);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        Ok(())
    }

    /// Removes the buckets of a run that did not finish.
    pub fn discard(self) {
        drop(self.buckets);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_record_comes_back_once_in_a_seeded_order() {
        let run = |seed| {
            let dir = tempfile::tempdir().unwrap();
            let mut s = Shuffler::new(dir.path(), seed).unwrap();
            for i in 0..1000 {
                s.push(&format!("{{\"i\":{i}}}")).unwrap();
            }
            let mut out = Vec::new();
            s.drain(|l| {
                out.push(l.to_owned());
                Ok(())
            })
            .unwrap();
            assert!(!dir.path().join(".shuffle").exists());
            out
        };
        let (a, b, c) = (run(1), run(1), run(2));
        assert_eq!(a, b, "same seed, same order");
        assert_ne!(a, c, "another seed, another order");
        let mut sorted = a.clone();
        sorted.sort_by_key(|l| l[5..l.len() - 1].parse::<u32>().unwrap());
        let expected: Vec<String> = (0..1000).map(|i| format!("{{\"i\":{i}}}")).collect();
        assert_eq!(sorted, expected, "a permutation");
        // Shuffled: the first 100 are not the input's first 100.
        let early = a[..100]
            .iter()
            .filter(|l| l[5..l.len() - 1].parse::<u32>().unwrap() < 100)
            .count();
        assert!(early < 40, "{early} of the first 100 stayed early");
    }
}
