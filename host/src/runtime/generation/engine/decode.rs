//! A decode step: every running row one token further in one decoder run, and a row running
//! alone with an n-gram draft as many tokens further as greedy decoding confirms.

use super::*;

impl Worker {
    /// One token further for every row, and with speculation (a greedy row whose last tokens
    /// occurred before) as many of its draft's tokens as greedy decoding confirms.
    pub(super) fn decode(&mut self) -> Result<()> {
        let b = self.rows.len();
        let seqs: Vec<(Seq, i64)> = self.rows.iter().map(|r| (r.seq(), r.next)).collect();
        let drafts = self.drafts();
        let width = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        // Each slot's adapter (free slots: none).
        let mut by_slot: Vec<Option<Arc<Adapter>>> = vec![None; self.store.batch_rows(b)];
        for row in &self.rows {
            if let Some(slot) = by_slot.get_mut(row.slot) {
                slot.clone_from(&row.sub.adapter);
            }
        }
        let by_slot: Vec<Option<&Arc<Adapter>>> = by_slot.iter().map(Option::as_ref).collect();
        let lora = self.stacks.as_mut().map(|s| s.run(&by_slot)).transpose()?;
        let lora = lora.as_ref();
        let mut rows = std::mem::take(&mut self.rows);
        let mut guides: Vec<&mut Guide> = rows
            .iter_mut()
            .filter_map(|r| r.sub.guide.as_mut())
            .collect();
        let (store, session, pad_id) = (&mut self.store, &mut self.session, self.limits.pad_id);
        let shrink = std::mem::take(&mut self.shrink_next);
        let result = if guides.is_empty() {
            store.decode(session, &seqs, &drafts, pad_id, shrink, lora)
        } else {
            // The guides' next masks are computed while the decoder runs the step, split
            // among helpers: one costly guide does not make every other row's mask wait.
            let helpers = std::thread::available_parallelism().map_or(2, |n| n.get());
            let per_helper = guides.len().div_ceil(helpers).max(1);
            std::thread::scope(|scope| {
                let spawned: Vec<_> = guides
                    .chunks_mut(per_helper)
                    .map(|chunk| {
                        std::thread::Builder::new()
                            .name("guided-masks".into())
                            .spawn_scoped(scope, || chunk.iter_mut().for_each(|g| g.prepare()))
                    })
                    .collect();
                let result = store.decode(session, &seqs, &drafts, pad_id, shrink, lora);
                for helper in spawned.into_iter().flatten() {
                    let _ = helper.join();
                }
                result
            })
        };
        self.rows = rows;
        let logits = result?;
        let (_, values) = logits.try_extract_tensor::<f32>().map_err(run_error)?;
        let vocab = values.len() / (self.store.batch_rows(b) * width);
        let mut keep = vec![true; b];
        let mut rows = std::mem::take(&mut self.rows);
        for (r, row) in rows.iter_mut().enumerate() {
            let draft = drafts.get(r).map_or(&[][..], Vec::as_slice);
            let mut taken = 0;
            // Position j of the row's run scores the token after its j-th draft token: taken
            // while the draft holds, the first token greedy decoding picks otherwise ends it.
            for j in 0..=draft.len() {
                row.len += 1;
                row.generated.push(row.next);
                let at = (row.slot * width + j) * vocab;
                let Some(slice) = values.get(at..at + vocab) else {
                    let _ = row.sub.steps.send(Err(run_error("no logits for the row")));
                    keep[r] = false;
                    break;
                };
                let mut row_logits = slice.to_vec();
                let token = match sample(row, &mut row_logits) {
                    Ok(token) => token,
                    Err(e) => {
                        let _ = row.sub.steps.send(Err(e));
                        keep[r] = false;
                        break;
                    }
                };
                self.stats
                    .inter_token_latency
                    .observe(row.last_token_at.elapsed());
                row.last_token_at = Instant::now();
                keep[r] = self.emit(row, token);
                let confirmed = draft.get(j) == Some(&i64::from(token));
                if confirmed {
                    taken += 1;
                    self.stats.spec_accepted_tokens.fetch_add(1, Relaxed);
                }
                if !keep[r] || !confirmed {
                    break;
                }
            }
            if !draft.is_empty() {
                if taken == 0 {
                    row.draft_misses += 1;
                    row.draft_wait = 1 << (row.draft_misses - 1).min(3);
                } else {
                    row.draft_misses = 0;
                }
            }
        }
        self.rows = rows;
        if keep.iter().any(|k| !k) {
            self.retain(&keep)?;
        }
        Ok(())
    }

    /// Each row's draft for this step (empty: none): with n-gram speculation configured, for a
    /// greedy row without a grammar running alone in a buffer of one row (ONNX Runtime's
    /// attention takes several new tokens after a past only for a batch of one), as long as
    /// the run fits the cache's columns and the draft the row's token limit.
    fn drafts(&mut self) -> Vec<Vec<i64>> {
        let none = || vec![Vec::new(); self.rows.len()];
        let (Some(config), Some(columns)) = (&self.limits.speculation, self.store.shared_columns())
        else {
            return none();
        };
        if self.rows.len() != 1 || self.store.batch_rows(1) != 1 {
            return none();
        }
        let room = self
            .rows
            .iter()
            .map(|r| columns.saturating_sub(r.len + 1))
            .min()
            .unwrap_or(0);
        let drafts: Vec<Vec<i64>> = self
            .rows
            .iter_mut()
            .map(|row| {
                if !row.sampler.is_greedy() || row.sub.guide.is_some() {
                    return Vec::new();
                }
                if row.draft_wait > 0 {
                    row.draft_wait -= 1;
                    return Vec::new();
                }
                // The tokens it may still answer after `next`.
                let left = row.sub.max_tokens.saturating_sub(row.generated.len() + 2);
                let mut context =
                    Vec::with_capacity(row.sub.prompt.len() + row.generated.len() + 1);
                context.extend_from_slice(&row.sub.prompt);
                context.extend_from_slice(&row.generated);
                context.push(row.next);
                config.propose(&context, left.min(room))
            })
            .collect();
        for d in drafts.iter().filter(|d| !d.is_empty()) {
            self.stats.spec_drafts.fetch_add(1, Relaxed);
            self.stats
                .spec_draft_tokens
                .fetch_add(d.len() as u64, Relaxed);
        }
        drafts
    }
}
