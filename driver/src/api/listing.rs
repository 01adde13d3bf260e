//! The control plane's listings: `GET /storage-pd/namespace` (the namespace
//! and its device) and `GET /storage-pd/publications` (the live
//! publications a caller may see, with `?state=` and `?verbose=1`).

use std::collections::BTreeMap;

use super::metrics::phase_name;
use super::wire::{ErrorBody, Extent, NamespaceInfo, PublicationInfo};
use crate::protocol::identity::{Caller, Role};
use crate::protocol::service::Service;

/// `GET /storage-pd/namespace`: the namespace the owner serves and its
/// device's NVMe identifiers.
pub(super) fn namespace(service: &Service, who: &Caller) -> Result<NamespaceInfo, ErrorBody> {
    who.require(Role::Any, "read the namespace's identity").map_err(|r| ErrorBody::new(r.code, r.field, r.message))?;
    let store = service.store();
    let sb = store.superblock();
    let info = NamespaceInfo {
        namespace: sb.uuid.to_string(),
        epoch: sb.epoch,
        slot_size: sb.slot_size,
        slot_count: sb.slot_count,
        device: pdstor_engine::io::DeviceIds::of(store.path()),
        reservations: service.holds_reservation(),
        write_cache: Some(store.write_cache()),
    };
    Ok(info)
}

/// `GET /storage-pd/publications`: a tenant sees only its own; an admin all.
pub(super) fn publications(
    service: &Service,
    who: &Caller,
    q: &BTreeMap<String, String>,
) -> Result<Vec<PublicationInfo>, ErrorBody> {
    who.require(Role::Any, "list publications").map_err(|r| ErrorBody::new(r.code, r.field, r.message))?;
    let mine = |p: &crate::store::Publication| {
        who.roles.admin || p.owner.as_ref().is_none_or(|o| who.tenant.as_deref() == Some(o.tenant.as_str()))
    };
    let want = q.get("state").map(|v| v.to_ascii_uppercase());
    let verbose = q.get("verbose").is_some_and(|v| v == "1" || v == "true");
    let sb = service.store().superblock();
    let list: Vec<PublicationInfo> = service
        .store()
        .publications()
        .into_iter()
        .filter(|p| mine(p) && want.as_deref().is_none_or(|w| w == phase_name(p.phase)))
        .map(|p| PublicationInfo {
            publication: p.id,
            req_id: p.req_id.clone(),
            state: phase_name(p.phase).into(),
            chunks: p.total_chunks,
            writer: p.writer.clone(),
            reader: p.claim.as_ref().map(|c| c.reader.clone()),
            unread_release_ms: p.unread_release_ms,
            cache: p.cache,
            reading: service.store().reads(p.id),
            extents: verbose.then(|| {
                let stored = |i: usize| p.chunks.get(i).and_then(Option::as_ref);
                let extent = |(i, &slot): (usize, &pdstor_client::layout::SlotIndex)| Extent {
                    chunk: i as u32,
                    slot: slot.0,
                    offset: sb.slot_offset(slot).0,
                    len: stored(i).map(|c| c.len),
                    crc32c: stored(i).map(|c| c.crc32c),
                };
                p.slots.iter().enumerate().map(extent).collect()
            }),
        })
        .collect();
    Ok(list)
}
