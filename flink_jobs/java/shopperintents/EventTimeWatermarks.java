package shopperintents;

import org.apache.flink.api.common.eventtime.Watermark;
import org.apache.flink.api.common.eventtime.WatermarkGenerator;
import org.apache.flink.api.common.eventtime.WatermarkGeneratorSupplier;
import org.apache.flink.api.common.eventtime.WatermarkOutput;
import org.apache.flink.api.common.eventtime.WatermarkStrategy;

import java.util.function.LongSupplier;

/**
 * Bounded out-of-orderness watermarks that keep moving when a partition goes quiet.
 *
 * <p>While records flow, the watermark is the newest record timestamp minus the bound, so
 * the job's event-time timers fire at the same points of a replayed topic every time. When
 * no record has come for {@code idleAdvanceAfterMs} plus the lag of the last record (how far
 * its timestamp was behind the wall clock when it was read), the watermark advances with the
 * wall clock from there: a shopper's last prompt must still fire when traffic stops, and
 * plain idleness would only stop this partition from holding others back. Counting the lag
 * matters when the job catches up a backlog (after a restart, under back-pressure): the
 * reader then pauses between old records, and a watermark that followed the wall clock
 * through those pauses would make the records still unread late. A partition that never
 * had a record is marked idle after {@code idlenessMs}. A timestamp more than {@code
 * maxLeadMs} ahead of the wall clock (a record the decoder dead-letters as from the future)
 * never moves the watermark: one bad clock must not make every other event late.
 *
 * <p>Quiet is only known if the task was running to see it. After a pause of the task (a
 * GC pause, a starved CPU) the periodic emit can run before the records that came in
 * meanwhile are read, and a watermark that followed the wall clock through the pause would
 * make them late. So when two emits are further apart than the bound plus {@code
 * idleAdvanceAfterMs} (a pause the wall-clock rule does not already tolerate), the
 * wall-clock advance waits that long again, for the reader to catch up.
 */
public final class EventTimeWatermarks implements WatermarkStrategy<Object> {
    private static final long serialVersionUID = 1L;

    private final long boundMs;
    private final long idleAdvanceAfterMs;
    private final long idlenessMs;
    private final long maxLeadMs;

    public EventTimeWatermarks(
            long boundMs, long idleAdvanceAfterMs, long idlenessMs, long maxLeadMs) {
        this.boundMs = boundMs;
        this.idleAdvanceAfterMs = idleAdvanceAfterMs;
        this.idlenessMs = idlenessMs;
        this.maxLeadMs = maxLeadMs;
    }

    @Override
    public WatermarkGenerator<Object> createWatermarkGenerator(
            WatermarkGeneratorSupplier.Context context) {
        return new Generator(
                boundMs, idleAdvanceAfterMs, idlenessMs, maxLeadMs, System::currentTimeMillis);
    }

    static final class Generator implements WatermarkGenerator<Object> {
        private final long boundMs;
        private final long idleAdvanceAfterMs;
        private final long idlenessMs;
        private final long maxLeadMs;
        private final LongSupplier clock;
        private final long createdMs;
        private long maxTimestamp = Long.MIN_VALUE;
        private long lastRecordWallMs;
        private long lastRecordLagMs;
        private long emitted = Long.MIN_VALUE;
        private long lastEmitWallMs;
        private long quietAdvanceHeldUntilMs = Long.MIN_VALUE;

        Generator(
                long boundMs,
                long idleAdvanceAfterMs,
                long idlenessMs,
                long maxLeadMs,
                LongSupplier clock) {
            this.boundMs = boundMs;
            this.idleAdvanceAfterMs = idleAdvanceAfterMs;
            this.idlenessMs = idlenessMs;
            this.maxLeadMs = maxLeadMs;
            this.clock = clock;
            this.createdMs = clock.getAsLong();
            this.lastEmitWallMs = createdMs;
        }

        @Override
        public void onEvent(Object event, long eventTimestamp, WatermarkOutput output) {
            long now = clock.getAsLong();
            if (eventTimestamp > maxTimestamp && eventTimestamp <= now + maxLeadMs) {
                maxTimestamp = eventTimestamp;
            }
            lastRecordWallMs = now;
            lastRecordLagMs = Math.max(0, now - maxTimestamp);
        }

        @Override
        public void onPeriodicEmit(WatermarkOutput output) {
            long now = clock.getAsLong();
            long pauseToleratedMs = boundMs + idleAdvanceAfterMs;
            if (now - lastEmitWallMs > pauseToleratedMs) {
                quietAdvanceHeldUntilMs = now + pauseToleratedMs;
            }
            lastEmitWallMs = now;
            if (maxTimestamp == Long.MIN_VALUE) {
                if (idlenessMs > 0 && now - createdMs >= idlenessMs) {
                    output.markIdle();
                }
                return;
            }
            long watermark = maxTimestamp - boundMs - 1;
            long advanceMs = now - lastRecordWallMs - idleAdvanceAfterMs - lastRecordLagMs;
            if (idleAdvanceAfterMs > 0 && advanceMs > 0 && now >= quietAdvanceHeldUntilMs) {
                watermark += advanceMs;
            }
            if (watermark > emitted) {
                emitted = watermark;
                output.emitWatermark(new Watermark(watermark));
            }
        }
    }
}
