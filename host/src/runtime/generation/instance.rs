//! An instance of a generation model: waits for one request, submits its sequences to the
//! engine and relays their steps as responses.

use super::*;

/// Waits for one sequence at a time: submits it to the engine and relays its steps.
pub(super) struct GenerationInstance {
    pub(super) engine: Arc<Engine>,
    pub(super) settings: Arc<Settings>,
    pub(super) decoupled: bool,
}

impl GenerationInstance {
    /// Runs one request: its sequences, decoded to the end (or until cancelled).
    fn run(
        &mut self,
        request: &InferRequest,
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        let started = Instant::now();
        let parsed = parse(request, &self.settings)?;
        let (steps_tx, steps) = mpsc::channel();
        // The sequence's own: cancelled with the request, or by this instance giving up.
        let cancel = request.cancel.child();
        let stop = match (&self.settings.text, parsed.stop.is_empty()) {
            (Some(text), false) => Some(StopStrings::new(parsed.stop, text.clone())),
            _ => None,
        };
        let prompt_tokens = parsed.prompt.len();
        // Kept only to spell a scored prompt (its scores come back without the ids).
        let prompt_ids = match parsed.prompt_log_probs {
            true => parsed.prompt.clone(),
            false => Vec::new(),
        };
        let prompt: Vec<u32> = if parsed.include_prompt && !parsed.stream {
            parsed.prompt.iter().map(|&t| t as u32).collect()
        } else {
            Vec::new()
        };
        let rules = TokenRules {
            bias: parsed.bias,
            end_ids: parsed.end_ids.clone(),
            min_tokens: parsed.min_tokens,
            banned: match &self.settings.text {
                Some(text) => BannedWords::new(parsed.bad_words, text.clone()),
                None => None,
            },
        };
        // Compiled here, on the request's thread, with its first mask: the engine only steps it.
        let guide = self.guide_of(request, &parsed.guide)?;
        let adapter = self.adapter_of(request)?;
        let mut namespace = self.namespace_of(request);
        if let Some(a) = &adapter {
            // An adapter changes every key and value: its prompts share no cache with others,
            // and their blocks' events name it.
            namespace = super::kv::events::scope_with_adapter(&namespace, a.id, &a.name);
        }
        self.engine.submit(Submission {
            party: party_of(request),
            rules,
            guide,
            namespace,
            adapter,
            log_probs: parsed.log_probs,
            top_log_probs: parsed.top_log_probs,
            prompt_log_probs: parsed.prompt_log_probs,
            prompt: parsed.prompt,
            max_tokens: parsed.max_tokens,
            sampling: parsed.sampling,
            end_ids: parsed.end_ids,
            stop,
            steps: steps_tx,
            cancel: cancel.clone(),
            arrived: started,
            deadline: timeout_of(request)
                .map(|t| started + t)
                .into_iter()
                .chain(request.deadline)
                .min(),
        })?;
        // Cancels the sequence however this returns (an error, the client gone); once it
        // finished, cancelling it is a no-op.
        let _cancel = cancel.cancel_on_drop();
        let sink = request
            .responses
            .as_ref()
            .filter(|_| self.decoupled && parsed.stream);
        let mut generated: Vec<u32> = Vec::new();
        let mut log_probs: Vec<f32> = Vec::new();
        let mut top: Vec<Vec<(u32, f32)>> = Vec::new();
        let mut scored: Option<PromptLogProbs> = None;
        let text = self.settings.text.as_deref();
        let top_k = parsed.top_log_probs;
        let gone = || {
            request.cancel.is_cancelled()
                || request.responses.as_ref().is_some_and(|s| s.is_closed())
        };
        loop {
            // Looked at before every step, not only while waiting: a sequence whose client
            // left stops within a step, even while tokens keep coming.
            if gone() {
                return Err(Error::new(Code::Cancelled, "the client has gone away"));
            }
            let step = match steps.recv_timeout(Duration::from_millis(50)) {
                Ok(step) => step?,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Error::unavailable(format!(
                        "model '{}': the generation loop stopped",
                        request.model_name
                    )))
                }
            };
            let mut step = step;
            let first = step.prompt.take();
            match sink {
                Some(sink) => {
                    let context_from = generated.len().saturating_sub(CONTEXT_TOKENS);
                    log_probs.extend_from_slice(&step.log_probs);
                    let tensors = response(
                        outputs,
                        &step.tokens,
                        &Extras {
                            context: &generated[context_from..],
                            finish: step.finish,
                            prompt_tokens,
                            generated_tokens: generated.len() + step.tokens.len(),
                            log_probs: &step.log_probs,
                            cum_log_prob: log_probs.iter().fold(0.0, |a, b| a + b),
                            new_tokens: &step.tokens,
                            top: &step.top,
                            top_k,
                            text,
                            prompt: first.as_ref().map(|p| (prompt_ids.as_slice(), p)),
                        },
                    );
                    generated.extend_from_slice(&step.tokens);
                    if step.finish.is_some() {
                        return Ok((tensors, timings(started)));
                    }
                    sink.send_blocking(tensors, None)?;
                }
                None => {
                    scored = scored.or(first);
                    generated.extend_from_slice(&step.tokens);
                    log_probs.extend_from_slice(&step.log_probs);
                    top.extend(step.top);
                    if step.finish.is_some() {
                        let tokens: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
                        let tensors = response(
                            outputs,
                            &tokens,
                            &Extras {
                                context: &[],
                                finish: step.finish,
                                prompt_tokens,
                                generated_tokens: generated.len(),
                                log_probs: &log_probs,
                                cum_log_prob: log_probs.iter().fold(0.0, |a, b| a + b),
                                new_tokens: &generated,
                                top: &top,
                                top_k,
                                text,
                                prompt: scored.as_ref().map(|p| (prompt_ids.as_slice(), p)),
                            },
                        );
                        return Ok((tensors, timings(started)));
                    }
                }
            }
        }
    }
}

/// The party a request's sequences belong to: the engine shares its rows among tenants, and
/// without tenants among client requests (every sequence of one request, its `n` choices
/// included, is one party).
fn party_of(request: &InferRequest) -> Party {
    match request.callers.first() {
        Some(crate::tenancy::Caller::Tenant(t)) => Party {
            key: format!("tenant {}", t.name),
            weight: t.weight(),
        },
        _ => Party {
            key: format!("request {}", request.cancel.root()),
            weight: 1.0,
        },
    }
}

impl GenerationInstance {
    /// Whose cached prefixes the prompt may reuse: its tenant's, or everyone's with
    /// `prefix_cache_scope: server`.
    fn namespace_of(&self, request: &InferRequest) -> String {
        match self.settings.shared_prefixes {
            true => String::new(),
            false => request
                .callers
                .first()
                .and_then(|c| c.tenant())
                .unwrap_or_default()
                .to_owned(),
        }
    }

    /// The LoRA adapter the request names (request parameter `lora`; an ensemble passes its
    /// parameters to this step), if any.
    fn adapter_of(&self, request: &InferRequest) -> Result<Option<Arc<lora::Adapter>>> {
        let name = match request.parameters.get(LORA_PARAMETER) {
            None => return Ok(None),
            Some(crate::inference::ParamValue::String(s)) if s.is_empty() => return Ok(None),
            Some(crate::inference::ParamValue::String(s)) => s,
            Some(_) => {
                return Err(Error::invalid(format!(
                    "model '{}': parameter '{LORA_PARAMETER}' must be an adapter's name (a string)",
                    request.model_name
                )))
            }
        };
        match &self.settings.adapters {
            Some(adapters) => adapters.get(name).map(Some),
            None => Err(Error::invalid(format!(
                "model '{}': parameter '{LORA_PARAMETER}' names adapter '{name}', but the \
                 decoder takes no LoRA adapters (it was exported without adapter inputs: \
                 scripts/llm_export.py --lora)",
                request.model_name
            ))),
        }
    }

    /// The request's guide (`guided_decoding_guide_type` and its text), compiled.
    fn guide_of(
        &self,
        request: &InferRequest,
        guide: &Option<(String, String)>,
    ) -> Result<Option<guided::Guide>> {
        match (guide, &self.settings.guides) {
            (Some((kind, text)), Some(guides)) => guides
                .compile(kind, text)
                .map(Some)
                .map_err(|e| e.within(format_args!("model '{}'", request.model_name))),
            _ => Ok(None),
        }
    }
}

impl ModelInstance for GenerationInstance {
    /// Several requests run as one, merged along the batch dimension and cut back (one
    /// request runs as it is).
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
        crate::runtime::batch::execute_merged(requests, outputs, |r, o| self.run(r, o))
    }
}

fn timings(started: Instant) -> ExecTimings {
    ExecTimings {
        compute_infer: started.elapsed(),
        ..Default::default()
    }
}
