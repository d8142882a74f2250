//! The mean of integers is exact, whatever the values: summed in the element type it would
//! wrap before the division (`[255, 255]` as u8 gave 127). Checked against the exact mean,
//! truncated towards zero, on 2, 3 and 4 ranks, both transports, every integer type, for
//! all-reduce, reduce and reduce-scatter (out of place and in place).

use hcomm::config::TransportKind;
use hcomm::testing::run_threads_with;
use hcomm::{Communicator, Element, ReduceOp};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// Rank `r`'s value `i`: near the type's ends, so that any sum in the type itself wraps.
fn value(r: usize, i: usize, min: i128, max: i128) -> i128 {
    match (r + i) % 4 {
        0 => max - (i as i128 % 3),
        1 => max,
        2 => min + (r as i128),
        _ => (max + min) / 2 + r as i128 * 7,
    }
}

fn check<T: Element + Copy + Default + PartialEq + std::fmt::Debug + TryFrom<i128>>(
    c: &Communicator,
    min: i128,
    max: i128,
) -> hcomm::Result<()>
where
    <T as TryFrom<i128>>::Error: std::fmt::Debug,
{
    let (n, me) = (c.world_size(), c.rank());
    let count = 3 * n; // reduce-scatter's equal blocks
    let mine: Vec<T> = (0..count)
        .map(|i| T::try_from(value(me, i, min, max)).unwrap())
        .collect();
    let expect: Vec<T> = (0..count)
        .map(|i| {
            let sum: i128 = (0..n).map(|r| value(r, i, min, max)).sum();
            T::try_from(sum / n as i128).unwrap()
        })
        .collect();
    let mut out = vec![T::default(); count];
    c.all_reduce(&mine, &mut out, ReduceOp::Mean)?;
    assert_eq!(out, expect, "all_reduce, rank {me} of {n}");
    let mut buf = mine.clone();
    c.all_reduce_in_place(&mut buf, ReduceOp::Mean)?;
    assert_eq!(buf, expect, "all_reduce in place, rank {me} of {n}");
    for root in 0..n {
        let mut out = vec![T::default(); count];
        c.reduce(&mine, &mut out, ReduceOp::Mean, root)?;
        if me == root {
            assert_eq!(out, expect, "reduce to {root}");
        }
    }
    let per = count / n;
    let mut block = vec![T::default(); per];
    c.reduce_scatter(&mine, &mut block, ReduceOp::Mean)?;
    assert_eq!(block, expect[me * per..(me + 1) * per], "reduce_scatter");
    let mut buf = mine.clone();
    c.reduce_scatter_in_place(&mut buf, ReduceOp::Mean)?;
    assert_eq!(
        buf[me * per..(me + 1) * per],
        expect[me * per..(me + 1) * per],
        "reduce_scatter in place"
    );
    Ok(())
}

fn all_types(n: usize, transport: TransportKind) {
    let res = run_threads_with(n, transport, T, |c| {
        check::<i8>(&c, i8::MIN as i128, i8::MAX as i128)?;
        check::<i16>(&c, i16::MIN as i128, i16::MAX as i128)?;
        check::<i32>(&c, i32::MIN as i128, i32::MAX as i128)?;
        check::<i64>(&c, i64::MIN as i128, i64::MAX as i128)?;
        check::<u8>(&c, 0, u8::MAX as i128)?;
        check::<u32>(&c, 0, u32::MAX as i128)?;
        check::<u64>(&c, 0, u64::MAX as i128)?;
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
}

#[test]
fn integer_means_do_not_wrap_on_2_3_4_ranks_over_shared_memory() {
    for n in [2, 3, 4] {
        all_types(n, TransportKind::Auto);
    }
}

#[test]
fn integer_means_do_not_wrap_on_2_3_4_ranks_over_tcp() {
    for n in [2, 3, 4] {
        all_types(n, TransportKind::Tcp);
    }
}
