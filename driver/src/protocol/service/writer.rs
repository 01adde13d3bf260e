//! The writer's steps: prepare (admission, quotas, a retry of the same
//! request), publish, abort and cancel, the reaper of idle and orphaned
//! prepares; and the unread release and lookup of READY publications.

use super::*;

impl Service {
    /// Step 1: admits a request and records its PREPARE (waits for capacity up to the admission timeout).
    pub fn prepare(
        &self,
        who: &Caller,
        req_id: &str,
        layout: &Layout,
        total_chunks: u32,
        writer: &str,
    ) -> Result<Prepared, ProtocolError> {
        self.prepare_with(who, req_id, layout, total_chunks, writer, None, &CancelToken::new())
    }

    /// [`prepare`](Self::prepare) waiting at most `timeout` (bounded by the
    /// daemon's admission timeout), giving up when `cancel` is set. A repeat
    /// of a PREPARED request (same chunks, layout, writer, owner) answers the same.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare_with(
        &self,
        who: &Caller,
        req_id: &str,
        layout: &Layout,
        total_chunks: u32,
        writer: &str,
        timeout: Option<Duration>,
        cancel: &CancelToken,
    ) -> Result<Prepared, ProtocolError> {
        self.prepare_as(who, Ask::new(req_id, writer, layout, total_chunks), timeout, cancel)
    }

    /// The prepare a client sent (`POST /storage-pd/prepare`, or a batch's
    /// step), its own unread window (`unread_release_ms`) among it.
    pub fn prepare_request(
        &self,
        who: &Caller,
        r: &PrepareRequest,
        cancel: &CancelToken,
    ) -> Result<Prepared, ProtocolError> {
        if r.unread_release_ms == Some(0) {
            return Err(Refusal::new(
                RefusalCode::BadRequest,
                "unread_release_ms",
                format!(
                    "request {}: unread_release_ms is 0; give the window in ms (at least 1), or leave it out to take the daemon's --unread-release-ms",
                    r.req_id
                ),
            )
            .into());
        }
        let ask = Ask {
            unread_release_ms: r.unread_release_ms,
            cache: r.cache,
            ..Ask::new(&r.req_id, &r.writer, &r.layout, r.total_chunks)
        };
        self.prepare_as(who, ask, r.timeout_ms.map(Duration::from_millis), cancel)
    }

    fn prepare_as(
        &self,
        who: &Caller,
        ask: Ask<'_>,
        timeout: Option<Duration>,
        cancel: &CancelToken,
    ) -> Result<Prepared, ProtocolError> {
        let Ask { req_id, writer, layout, total_chunks, .. } = ask;
        bounded("req_id", req_id, MAX_NAME_BYTES)?;
        bounded("writer_id", writer, MAX_NAME_BYTES)?;
        for (field, value) in [
            ("layout.model_id", &layout.model_id),
            ("layout.dtype", &layout.dtype),
            ("layout.kv_format", &layout.kv_format),
        ] {
            bounded(field, value, MAX_NAME_BYTES)?;
        }
        who.require(Role::Writer, "prepare")?;
        let owner = who.owner();
        let quota = self.quota_for_prepare(who, total_chunks);
        self.policy.take(who, quota)?;
        let timeout = timeout.unwrap_or(Duration::MAX);
        if let Err(e) = self.evict_for(who, Some(req_id), total_chunks) {
            self.policy.give(who, quota);
            return Err(e);
        }
        // The first prepare of an id being handled is the one recorded: a
        // second (a retry, or another caller's, which the store refuses) never
        // replaces nor removes that record, so it cannot make itself the one
        // `cancel` lets give the first up.
        let recorded = match self.lock_preparing().entry(req_id.to_owned()) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(who.principal.clone());
                true
            }
            std::collections::hash_map::Entry::Occupied(_) => false,
        };
        let prepared = self.store.prepare_with(&Ask { owner: owner.as_ref(), ..ask }, timeout, cancel);
        if recorded {
            self.lock_preparing().remove(req_id);
        }
        self.policy.give(who, quota);
        let p = prepared?;
        let detail = if p.repeated {
            format!("writer {writer}; a repeat of the same request: the same publication")
        } else {
            format!("writer {writer}")
        };
        self.note(who, Event::new("prepare").req(req_id).publication(p.publication).detail(detail));
        let writer_token = self.signer.writer_token(p.publication, req_id);
        Ok(Prepared {
            publication: p.publication,
            writer_token,
            namespace: self.namespace().into(),
            epoch: self.store.epoch(),
        })
    }

    /// Under capacity pressure, makes room for a new prepare of `chunks`
    /// (`req_id`), and for the prepares already waiting, by evicting unread
    /// READY publications of the tenants that opted in (none opted in:
    /// nothing to do). It runs when a prepare comes and when a publication
    /// becomes READY — the two moments demand or something evictable appears.
    /// A retry of a PREPARED request needs no room.
    fn evict_for(&self, who: &Caller, req_id: Option<&str>, chunks: u32) -> Result<(), ProtocolError> {
        let rules = self.policy.rules();
        if !rules.any_evicts() || req_id.is_some_and(|r| self.store.publication_of(r).is_some()) {
            return Ok(());
        }
        let for_whom = req_id.map_or_else(|| "the waiting prepares".to_owned(), str::to_owned);
        let evictable = |owner: Option<&Owner>| rules.evicts_unread(owner.map(|o| o.tenant.as_str()));
        for e in self.store.evict_unread(chunks as u64, &evictable)? {
            let tenant = e.owner.as_ref().map_or(crate::protocol::identity::DEFAULT_TENANT, |o| o.tenant.as_str());
            tracing::info!(
                "evicted unread publication {} ({}, tenant {tenant}, {} slots) to make room for {for_whom}",
                e.publication,
                e.req_id,
                e.slots
            );
            let detail = format!("unread, tenant {tenant}, {} slots, to make room for {for_whom}", e.slots);
            self.note(who, Event::new("evict").req(&e.req_id).publication(e.publication).detail(detail));
        }
        Ok(())
    }

    fn lock_preparing(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.preparing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What a prepare of `chunks` by `who` takes from its tenant's quota: the
    /// tenant's live holdings are counted only when it has a quota to compare.
    fn quota_for_prepare(&self, who: &Caller, chunks: u32) -> Resource {
        let q = who.tenant.as_deref().map(|t| self.policy.rules().quota(t)).unwrap_or_default();
        let (mut held, mut outstanding) = (0, 0);
        if q.slots.is_some() || q.prepares.is_some() {
            for p in self.store.publications() {
                if p.owner.as_ref().is_some_and(|o| Some(o.tenant.as_str()) == who.tenant.as_deref()) {
                    held += p.slots.len() as u64;
                    outstanding += usize::from(p.phase == Phase::Prepared);
                }
            }
        }
        Resource::Prepare { slots: chunks as u64, held, outstanding }
    }

    /// Step 3: READY; returns the signed receipt and the manifest.
    pub fn publish(
        &self,
        who: &Caller,
        publication: u64,
        writer_token: &str,
        first_token: Option<u32>,
    ) -> Result<Published, ProtocolError> {
        self.check_writer(who, publication, writer_token)?;
        let recording = self.publishing.read().unwrap_or_else(|e| e.into_inner());
        let manifest = self.store.publish(publication, first_token)?;
        let p = self.live(publication)?;
        let receipt = self.receipt(ReceiptKind::Ready, &p, self.store.epoch())?;
        let mut e = Event::new("publish").req(&receipt.req_id).publication(publication).receipt(&receipt.signature);
        e.chunks = Some(manifest.chunks.len() as u32);
        e.crcs = Some(manifest.chunks.iter().map(|c| c.crc32c).collect());
        e.token = manifest.first_token;
        self.note(who, e);
        drop(recording);
        // A new READY publication is something waiting prepares may be given
        // room from. The publish stands whatever the eviction does.
        if let Err(err) = self.evict_for(who, None, 0) {
            tracing::warn!("after publishing {publication}: evicting for the waiting prepares failed: {err}");
        }
        Ok(Published { receipt, manifest })
    }

    /// Frees a READY publication that was never claimed.
    pub fn release(&self, who: &Caller, ready: &Receipt) -> Result<(), ProtocolError> {
        who.require(Role::Writer, "release")?;
        self.after_publishes();
        let p = self.check(ready, ReceiptKind::Ready)?;
        who.require_owner(p.owner.as_ref(), &format!("publication {}", p.id))?;
        if p.phase != Phase::Ready {
            return Err(Refusal::new(
                RefusalCode::AlreadyClaimed,
                "publication",
                format!("publication {} is {:?}: only unread READY can be released", p.id, p.phase),
            )
            .into());
        }
        self.store.release(p.id)?;
        self.note(who, Event::new("release").req(&ready.req_id).publication(p.id).receipt(&ready.signature));
        Ok(())
    }

    /// The READY receipt of each request in `req_ids`, freshly signed, or
    /// `None` where there is none the caller may use: no live publication of
    /// that request, not READY (still being written, or already claimed), or
    /// one the caller may neither claim (a reader of a tenant its owner lets
    /// read) nor release (its owner). A reader that knows only the request's
    /// name — an LMCache key — finds the receipt to claim with; it learns
    /// nothing `publications` would not show it.
    pub fn lookup(&self, who: &Caller, req_ids: &[String]) -> Result<Vec<Option<Receipt>>, ProtocolError> {
        who.require(Role::Any, "lookup")?;
        if req_ids.len() > MAX_LOOKUP {
            return Err(Refusal::new(
                RefusalCode::BadRequest,
                "req_ids",
                format!("lookup names {} requests; at most {MAX_LOOKUP} at a time", req_ids.len()),
            )
            .into());
        }
        for r in req_ids {
            bounded("req_ids", r, MAX_NAME_BYTES)?;
        }
        let usable = |p: &Publication| {
            let Some(owner) = &p.owner else { return true };
            who.roles.admin || (who.roles.writer && who.is(owner)) || (who.roles.reader && self.may_read(who, owner))
        };
        let epoch = self.store.epoch();
        req_ids
            .iter()
            .map(|r| match self.store.publication_of(r) {
                Some(p) if p.phase == Phase::Ready && usable(&p) => {
                    self.receipt(ReceiptKind::Ready, &p, epoch).map(Some).map_err(Into::into)
                }
                _ => Ok(None),
            })
            .collect()
    }

    /// Rolls back a publication that is not READY yet.
    pub fn abort(&self, who: &Caller, publication: u64, writer_token: &str) -> Result<AbortOutcome, ProtocolError> {
        who.require(Role::Writer, "abort")?;
        if self.store.publication(publication).is_none() {
            return Ok(AbortOutcome::NotFound);
        }
        self.check_writer(who, publication, writer_token)?;
        let outcome = self.store.abort(publication)?;
        self.note(who, Event::new("abort").publication(publication).detail(format!("{outcome:?}")));
        Ok(outcome)
    }

    /// Aborts PREPARED publications idle for `idle`, or orphaned for
    /// `orphan_grace` ([`Store::reap_idle`]), each recorded on the timeline;
    /// returns how many.
    pub fn reap_idle(&self, idle: Duration, orphan_grace: Duration) -> usize {
        let reaped = self.store.reap_idle(idle, orphan_grace);
        for r in &reaped {
            let why = if r.orphaned {
                format!(
                    "orphaned: its prepare's answer never reached the client, and no store batch came within {} ms",
                    orphan_grace.as_millis()
                )
            } else {
                format!("idle: no store batch for {} ms", idle.as_millis())
            };
            self.note(&Caller::in_process(), Event::new("abort").req(&r.req_id).publication(r.publication).detail(why));
        }
        reaped.len()
    }

    /// Releases the READY publications no reader claimed within their
    /// unread window — their writer's, their tenant's (the config's
    /// `unread_release_ms`) or `after` (the daemon's `--unread-release-ms`),
    /// the shortest ([`Store::release_unread_after`]), each an `expire` on
    /// the timeline; returns how many.
    pub fn release_unread_after(&self, after: Option<Duration>) -> Result<usize, ProtocolError> {
        let rules = self.policy.rules();
        if after.is_none() && !rules.any_unread_release() && !self.store.any_unread_window() {
            return Ok(0); // no window to look at (LMCache's keys alone): no lock taken
        }
        // Never recorded before the publish that made it READY.
        self.after_publishes();
        let tenants = |owner: Option<&Owner>| rules.unread_release(owner.map(|o| o.tenant.as_str()));
        let shortest = |a: Option<Duration>, b: Option<Duration>| a.map_or(b, |a| Some(b.map_or(a, |b| a.min(b))));
        let expired = self.store.release_unread_after(|owner| shortest(after, tenants(owner)))?;
        for e in &expired {
            let window = e.window.map_or(0, |w| w.as_millis());
            tracing::warn!(
                "released unread publication {} ({}, {} slots): no reader claimed it within {window} ms",
                e.publication,
                e.req_id,
                e.slots,
            );
            let whose = if e.window == after {
                "--unread-release-ms"
            } else if e.window == tenants(e.owner.as_ref()) {
                "its tenant's unread_release_ms"
            } else {
                "its writer's unread_release_ms"
            };
            let detail = format!("unread for {window} ms ({whose}), {} slots", e.slots);
            self.note(
                &Caller::in_process(),
                Event::new("expire").req(&e.req_id).publication(e.publication).detail(detail),
            );
        }
        Ok(expired.len())
    }

    /// Cancels request `req_id` ([`Store::cancel_request`]): a waiting
    /// prepare is refused, a PREPARED publication rolled back. Idempotent.
    pub fn cancel(&self, who: &Caller, req_id: &str) -> Result<CancelOutcome, ProtocolError> {
        who.require(Role::Writer, "cancel")?;
        bounded("req_id", req_id, MAX_NAME_BYTES)?;
        // Only whoever asked for the request (or an admin) gives it up.
        if let Some(p) = self.store.publication_of(req_id) {
            who.require_owner(p.owner.as_ref(), &format!("request {req_id}"))?;
        } else if let Some(principal) = self.lock_preparing().get(req_id)
            && *principal != who.principal
            && !who.roles.admin
        {
            return Err(Refusal::new(
                RefusalCode::NotOwner,
                "caller",
                format!("request {req_id} is being prepared by {principal}; {who} is not it (nor an admin)"),
            )
            .into());
        }
        let outcome = self.store.cancel_request(req_id)?;
        let mut e = Event::new("cancel").req(req_id).detail(format!("{outcome:?}"));
        if let CancelOutcome::Aborted { publication, .. } | CancelOutcome::Pending { publication } = outcome {
            e = e.publication(publication);
        }
        self.note(who, e);
        Ok(outcome)
    }

    /// A PREPARED publication whose prepare's answer never reached its client:
    /// rolled back after the orphan grace unless a store batch comes.
    pub fn orphan(&self, publication: u64, req_id: &str) {
        self.store.orphan(publication);
        self.note(
            &Caller::in_process(),
            Event::new("orphaned")
                .req(req_id)
                .publication(publication)
                .detail("the client went away before the prepare's answer reached it"),
        );
    }
}
