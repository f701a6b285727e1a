//! Who joins the running batch between two steps: waiting sequences in order, within the
//! cache budget and each party's fair share of the rows (the rows divided by the weights of
//! the parties that hold or want them); a party over its share that holds a row a waiting
//! party needs is preempted (its newest sequence leaves, keeping what it generated, and
//! resumes later by prefilling again); sequences whose client left are dropped.

use super::*;

impl Worker {
    /// Chooses what joins the batch now: waiting requests and preempted sequences, the party
    /// furthest below its share first (oldest first within a party, a preempted sequence
    /// before a new request), while the batch stays within its limits (rows, rows x the
    /// longest final length within the cache budget, the prefill budget). When the next one
    /// does not fit and its party is below its share, the newest sequence of the party most
    /// over its share is preempted to make room.
    pub(super) fn admit(&mut self) -> (Vec<Submission>, Vec<Row>) {
        let mut admitted: Vec<Submission> = Vec::new();
        let mut resumed: Vec<Row> = Vec::new();
        if self.waiting.is_empty() && self.preempted.is_empty() {
            return (admitted, resumed);
        }
        let mut prefill = 0;
        // Sequences preempted by this call do not come back in it.
        let mut fresh = 0;
        loop {
            let joined = || admitted.iter().map(|s| (&s.party, s.final_len()));
            let shares = Shares::new(
                self.limits.max_rows,
                self.rows
                    .iter()
                    .map(|r| (&r.sub.party, r.sub.final_len()))
                    .chain(resumed.iter().map(|r| (&r.sub.party, r.sub.final_len())))
                    .chain(joined()),
                self.preempted
                    .iter()
                    .map(|r| &r.sub.party)
                    .chain(self.waiting.iter().map(|s| &s.party)),
            );
            let returning = self.preempted.len() - fresh;
            let Some(next) = self.next_candidate(&shares, returning) else {
                break;
            };
            let (party, final_len, tokens) = match next {
                Candidate::Preempted(i) => {
                    let r = &self.preempted[i];
                    (r.sub.party.clone(), r.sub.final_len(), r.len)
                }
                Candidate::Waiting(i) => {
                    let s = &self.waiting[i];
                    (s.party.clone(), s.final_len(), s.prompt.len())
                }
            };
            let rows = shares.rows + 1;
            let longest = shares.longest.max(final_len);
            if rows <= self.limits.max_rows && rows * longest <= self.limits.cache_tokens {
                if (!admitted.is_empty() || !resumed.is_empty())
                    && prefill + tokens > self.limits.max_prefill_tokens
                {
                    break;
                }
                prefill += tokens;
                match next {
                    Candidate::Preempted(i) => resumed.extend(self.preempted.remove(i)),
                    Candidate::Waiting(i) => admitted.extend(self.waiting.remove(i)),
                }
                continue;
            }
            // No room: make some at the expense of a party over its share, if this one is
            // below its own.
            if shares.held(&party.key) >= shares.fair(&party.key) {
                break;
            }
            let Some(victim) = shares.most_over() else {
                break;
            };
            let Some(at) = self.rows.iter().rposition(|r| r.sub.party.key == victim) else {
                break;
            };
            if let Err(e) = self.preempt(at) {
                tracing::error!("{e}");
                break;
            }
            fresh += 1;
        }
        (admitted, resumed)
    }

    /// The next sequence to join: of the party with the fewest rows for its weight, its
    /// oldest preempted sequence (among the first `returning`), else its oldest waiting
    /// request.
    fn next_candidate(&self, shares: &Shares, returning: usize) -> Option<Candidate> {
        let first_of = |key: &str| {
            self.preempted
                .iter()
                .take(returning)
                .position(|r| r.sub.party.key == key)
                .map(Candidate::Preempted)
                .or_else(|| {
                    self.waiting
                        .iter()
                        .position(|s| s.party.key == key)
                        .map(Candidate::Waiting)
                })
        };
        let arrived = |c: &Candidate| match *c {
            Candidate::Preempted(i) => self.preempted[i].sub.arrived,
            Candidate::Waiting(i) => self.waiting[i].arrived,
        };
        shares
            .wanting()
            .filter_map(|key| Some((shares.load(key), first_of(key)?)))
            .min_by(|(a, ca), (b, cb)| a.total_cmp(b).then(arrived(ca).cmp(&arrived(cb))))
            .map(|(_, c)| c)
    }

    /// Takes the running sequence at `at` out of the batch, keeping what it generated.
    fn preempt(&mut self, at: usize) -> Result<()> {
        let kept: Vec<Seq> = (self.rows.iter().enumerate())
            .filter(|(i, _)| *i != at)
            .map(|(_, r)| r.seq())
            .collect();
        let slots = self.store.retain(&self.session, &kept)?;
        let row = self.rows.remove(at);
        for (r, slot) in self.rows.iter_mut().zip(slots) {
            r.slot = slot;
        }
        self.stats.preemptions.fetch_add(1, Relaxed);
        self.preempted.push_back(row);
        Ok(())
    }

    /// Brings preempted sequences back: their prompts and the tokens they generated are
    /// prefilled again in one run (the logits are not needed: each already sampled its next
    /// token), then they join the batch where they left off.
    pub(super) fn resume(&mut self, rows: Vec<Row>) -> Result<()> {
        let tokens: Vec<Vec<i64>> = rows
            .iter()
            .map(|r| r.sub.prompt.iter().chain(&r.generated).copied().collect())
            .collect();
        let refs: Vec<&[i64]> = tokens.iter().map(Vec::as_slice).collect();
        let adapters: Vec<Option<&Arc<Adapter>>> =
            rows.iter().map(|r| r.sub.adapter.as_ref()).collect();
        let prefilled = self.run_prefill(&refs, &adapters, None, false);
        drop(adapters);
        let part = match prefilled {
            Ok(p) => p.part,
            Err(e) => {
                for r in rows {
                    let _ = r.sub.steps.send(Err(e.clone()));
                }
                return Err(e);
            }
        };
        let seqs = rows
            .iter()
            .enumerate()
            .map(|(i, r)| (i, r.len, r.sub.final_len()))
            .collect();
        let running: Vec<Seq> = self.rows.iter().map(Row::seq).collect();
        let slots = self
            .store
            .join(&self.session, &running, vec![(part, seqs)])?;
        self.rows.extend(rows);
        for (row, slot) in self.rows.iter_mut().zip(slots) {
            row.slot = slot;
        }
        Ok(())
    }

    pub(super) fn drop_cancelled(&mut self) {
        let preempted = self.preempted.len();
        self.preempted.retain(|r| !r.sub.cancel.is_cancelled());
        self.stats
            .finished_cancelled
            .fetch_add((preempted - self.preempted.len()) as u64, Relaxed);
        let before = self.rows.len();
        let keep: Vec<bool> = self
            .rows
            .iter()
            .map(|r| !r.sub.cancel.is_cancelled())
            .collect();
        if keep.iter().all(|&k| k) {
            return;
        }
        self.stats.finished_cancelled.fetch_add(
            (before - keep.iter().filter(|&&k| k).count()) as u64,
            Relaxed,
        );
        if let Err(e) = self.retain(&keep) {
            tracing::error!("{e}");
        }
    }
}

/// Where the next sequence to join comes from.
#[derive(Debug, Clone, Copy)]
enum Candidate {
    /// `preempted[i]`.
    Preempted(usize),
    /// `waiting[i]`.
    Waiting(usize),
}

/// The batch's rows as the parties hold them, and the parties that wait.
struct Shares {
    max_rows: usize,
    /// Rows in the batch (and joining it).
    rows: usize,
    /// The longest final length among them.
    longest: usize,
    /// Per party: its key, weight, rows held, whether it waits.
    parties: Vec<(String, f64, usize, bool)>,
}

impl Shares {
    fn new<'a>(
        max_rows: usize,
        held: impl Iterator<Item = (&'a Party, usize)>,
        wanting: impl Iterator<Item = &'a Party>,
    ) -> Self {
        let mut shares = Shares {
            max_rows,
            rows: 0,
            longest: 0,
            parties: Vec::new(),
        };
        for (party, final_len) in held {
            shares.rows += 1;
            shares.longest = shares.longest.max(final_len);
            shares.entry(party).2 += 1;
        }
        for party in wanting {
            shares.entry(party).3 = true;
        }
        shares
    }

    fn entry(&mut self, party: &Party) -> &mut (String, f64, usize, bool) {
        let i = match self.parties.iter().position(|p| p.0 == party.key) {
            Some(i) => i,
            None => {
                self.parties
                    .push((party.key.clone(), party.weight.max(1e-6), 0, false));
                self.parties.len() - 1
            }
        };
        &mut self.parties[i]
    }

    /// The parties that wait.
    fn wanting(&self) -> impl Iterator<Item = &str> {
        self.parties.iter().filter(|p| p.3).map(|p| p.0.as_str())
    }

    /// Rows a party holds.
    fn held(&self, key: &str) -> usize {
        self.parties.iter().find(|p| p.0 == key).map_or(0, |p| p.2)
    }

    /// Rows held for its weight.
    fn load(&self, key: &str) -> f64 {
        self.parties
            .iter()
            .find(|p| p.0 == key)
            .map_or(0.0, |p| p.2 as f64 / p.1)
    }

    /// A party's fair share of the rows: the rows divided among the parties that hold or
    /// want some, by weight (at least one).
    fn fair(&self, key: &str) -> usize {
        let total: f64 = self.parties.iter().map(|p| p.1).sum();
        let weight = self
            .parties
            .iter()
            .find(|p| p.0 == key)
            .map_or(1.0, |p| p.1);
        ((self.max_rows as f64 * weight / total).floor() as usize).max(1)
    }

    /// The party holding the most rows beyond its share, if any holds more than its share.
    fn most_over(&self) -> Option<String> {
        self.parties
            .iter()
            .filter(|p| p.2 > self.fair(&p.0))
            .max_by(|a, b| {
                let over = |p: &(String, f64, usize, bool)| p.2 as f64 - self.fair(&p.0) as f64;
                over(a).total_cmp(&over(b))
            })
            .map(|p| p.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn party(key: &str, weight: f64) -> Party {
        Party {
            key: key.into(),
            weight,
        }
    }

    #[test]
    fn rows_are_shared_by_weight_among_the_parties_that_hold_or_want_them() {
        let (a, b, c) = (party("a", 1.0), party("b", 1.0), party("c", 2.0));
        // a holds all 32 rows; b waits.
        let held: Vec<(&Party, usize)> = (0..32).map(|_| (&a, 100)).collect();
        let shares = Shares::new(32, held.iter().copied(), [&b].into_iter());
        assert_eq!((shares.rows, shares.longest), (32, 100));
        assert_eq!((shares.fair("a"), shares.fair("b")), (16, 16));
        assert_eq!(shares.most_over().as_deref(), Some("a"));
        assert_eq!(shares.wanting().collect::<Vec<_>>(), ["b"]);
        assert!(shares.load("b") < shares.load("a"));
        // Weights: c counts twice.
        let shares = Shares::new(32, held.iter().copied(), [&b, &c].into_iter());
        assert_eq!(
            (shares.fair("a"), shares.fair("b"), shares.fair("c")),
            (8, 8, 16)
        );
        // Alone, a party may have every row, and nobody is over its share.
        let shares = Shares::new(32, held.iter().copied(), [&a].into_iter());
        assert_eq!(shares.fair("a"), 32);
        assert!(shares.most_over().is_none());
        // More parties than rows: each is owed one.
        let many: Vec<Party> = (0..40).map(|i| party(&i.to_string(), 1.0)).collect();
        let shares = Shares::new(4, std::iter::empty(), many.iter());
        assert_eq!(shares.fair("7"), 1);
    }
}
