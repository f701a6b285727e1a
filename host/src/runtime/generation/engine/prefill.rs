//! Prefilling the prompts of the sequences that join the batch: grouped by the cached prefix
//! they reuse, each group in one decoder run (left-padded), the first token sampled, and the
//! prompts worth keeping handed to the prefix cache.

use super::*;

impl Worker {
    /// Prefills `new` and adds the sequences that go on to the batch. Prompts that share a
    /// cached prefix each run alone after it (their pasts differ); the others run together.
    pub(super) fn prefill(&mut self, new: Vec<Submission>) -> Result<()> {
        let scored = new.iter().any(|s| s.prompt_log_probs);
        let mut together: Vec<Submission> = Vec::new();
        let mut later = VecDeque::new();
        let mut groups: Vec<(Vec<Submission>, Option<Hit>)> = Vec::new();
        for s in new {
            if s.prompt_log_probs {
                // Scored whole: every position's logits, in a run of its own.
                groups.push((vec![s], None));
                continue;
            }
            if !self.prefixes.enabled() {
                together.push(s);
                continue;
            }
            self.stats
                .prefix_cache_queries
                .fetch_add(s.prompt.len() as u64, Relaxed);
            match self.prefixes.lookup(&s.namespace, &s.prompt) {
                Some(hit) => {
                    self.stats
                        .prefix_cache_hits
                        .fetch_add(hit.tokens as u64, Relaxed);
                    groups.push((vec![s], Some(hit)));
                }
                // A prompt sharing its beginning with one prefilled now (the choices of `n`,
                // a burst on one system prompt) runs after it, from its cache.
                None if together.iter().any(|t| shares_prefix(t, &s)) => later.push_back(s),
                None => together.push(s),
            }
        }
        if !together.is_empty() {
            groups.insert(0, (together, None));
        }
        let mut joining: Vec<Joining> = Vec::new();
        let mut rows: Vec<Row> = Vec::new();
        let mut failed = None;
        let mut groups: VecDeque<_> = groups.into();
        while let Some((subs, hit)) = groups.pop_front().or_else(|| {
            let s = later.pop_front()?;
            let hit = self.prefixes.lookup(&s.namespace, &s.prompt);
            if let Some(h) = &hit {
                self.stats
                    .prefix_cache_hits
                    .fetch_add(h.tokens as u64, Relaxed);
            }
            Some((vec![s], hit))
        }) {
            match self.prefill_group(subs, hit.as_ref()) {
                Ok((joined, part)) => {
                    let seqs = joined
                        .iter()
                        .map(|(row, r)| (*row, r.len, r.sub.final_len()))
                        .collect();
                    rows.extend(joined.into_iter().map(|(_, r)| r));
                    joining.push((part, seqs));
                }
                Err(e) => failed = Some(e),
            }
        }
        if scored {
            // A scored prompt's every-position logits and activations are freed by now: give
            // the memory back rather than keep the peak.
            crate::runtime::heap::release_freed();
        }
        if !rows.is_empty() {
            let running: Vec<Seq> = self.rows.iter().map(Row::seq).collect();
            let slots = self.store.join(&self.session, &running, joining)?;
            self.rows.extend(rows);
            for (row, slot) in self.rows.iter_mut().zip(slots) {
                row.slot = slot;
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Runs the prompts of `new` in one decoder run (after the cached prefix `hit` when there
    /// is one, for a single prompt), keeps their caches for later prompts, samples their first
    /// tokens. Returns the sequences that go on (with their rows in the run) and their cache.
    fn prefill_group(
        &mut self,
        new: Vec<Submission>,
        hit: Option<&Hit>,
    ) -> Result<(Vec<(usize, Row)>, Part)> {
        let n = new.len();
        let past_len = hit.map_or(0, |h| h.tokens);
        let prompts: Vec<&[i64]> = new.iter().map(|s| s.prompt.as_slice()).collect();
        let all = hit.is_none() && new.iter().any(|s| s.prompt_log_probs);
        self.shrink_next |= all;
        let adapters: Vec<Option<&Arc<Adapter>>> = new.iter().map(|s| s.adapter.as_ref()).collect();
        let result = self.run_prefill(&prompts, &adapters, hit, all);
        drop(prompts);
        drop(adapters);
        let Prefilled { logits, part } = match result {
            Ok(v) => v,
            Err(e) => {
                for s in new {
                    let _ = s.steps.send(Err(e.clone()));
                }
                return Err(e);
            }
        };
        let prompt_tokens: usize = new.iter().map(|s| s.prompt.len() - past_len).sum();
        self.stats
            .prompt_tokens
            .fetch_add(prompt_tokens as u64, Relaxed);
        self.keep_prefixes(&new, &part)?;
        let (shape, values) = logits.try_extract_tensor::<f32>().map_err(run_error)?;
        // Optimum's exports answer every position's logits; ours only the last position's.
        let positions = shape.get(1).map_or(1, |&p| p.max(1) as usize);
        let vocab = values.len() / (n * positions).max(1);
        let mut joining = Vec::new();
        for (r, mut sub) in new.into_iter().enumerate() {
            let last = self
                .store
                .last_position(positions, sub.prompt.len(), past_len);
            let at = (r * positions + last) * vocab;
            let mut row_logits = values[at..at + vocab].to_vec();
            let whole = positions > 1 || sub.prompt.len() == 1;
            let prompt_log_probs = (sub.prompt_log_probs && hit.is_none() && whole).then(|| {
                // The logits after prompt token i score token i + 1.
                let store = &self.store;
                sampling::score_prompt(&sub.prompt, sub.top_log_probs, |i| {
                    let at = (r * positions
                        + store.prompt_position(positions, sub.prompt.len(), i))
                        * vocab;
                    values.get(at..at + vocab)
                })
            });
            let rules = std::mem::take(&mut sub.rules);
            let mut row = Row {
                sampler: Sampler::new(sub.sampling.clone())
                    .with_rules(rules)
                    .with_log_probs(sub.log_probs)
                    .with_top_log_probs(sub.top_log_probs),
                pending_log_probs: VecDeque::new(),
                prompt_log_probs,
                draft_misses: 0,
                draft_wait: 0,
                slot: r,
                len: sub.prompt.len(),
                next: 0,
                generated: Vec::new(),
                last_token_at: Instant::now(),
                sub,
            };
            let token = match sample(&mut row, &mut row_logits) {
                Ok(token) => token,
                Err(e) => {
                    let _ = row.sub.steps.send(Err(e));
                    continue;
                }
            };
            self.stats
                .time_to_first_token
                .observe(row.sub.arrived.elapsed());
            if self.emit(&mut row, token) {
                joining.push((r, row));
            }
        }
        Ok((joining, part))
    }

    /// One decoder run of `prompts` (after `hit`), each with its adapter (by prompt).
    pub(super) fn run_prefill(
        &mut self,
        prompts: &[&[i64]],
        adapters: &[Option<&Arc<Adapter>>],
        hit: Option<&Hit>,
        all: bool,
    ) -> Result<Prefilled> {
        let lora = self.stacks.as_mut().map(|s| s.run(adapters)).transpose()?;
        let pad_id = self.limits.pad_id;
        self.store
            .prefill(&mut self.session, prompts, hit, pad_id, all, lora.as_ref())
    }

    /// Keeps the caches of the prompts just prefilled (rows of `part`) that the prefix cache
    /// wants.
    fn keep_prefixes(&mut self, new: &[Submission], part: &Part) -> Result<()> {
        for (r, s) in new.iter().enumerate() {
            if !self.prefixes.wants(&s.namespace, &s.prompt) {
                continue;
            }
            let values = self.store.prefix_values(part, r, s.prompt.len())?;
            self.prefixes.insert(&s.namespace, &s.prompt, values);
        }
        self.publish_kv_events();
        self.stats
            .prefix_cache_tokens
            .store(self.prefixes.used_tokens() as i64, Relaxed);
        Ok(())
    }
}
